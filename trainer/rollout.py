"""The trainer's rollout client, `RolloutClient`: OpenAI-compatible requests to the engines the
daemon routes to, each re-sent elsewhere when its engine fails, continued from the tokens it
already streamed, and answered exactly once or raised as a `RolloutError`.

    async with RolloutClient(AsyncSupervisorClient()) as rollout:
        results = await rollout.gather(prompts, max_tokens=64)

The continuation's half is continuation.py, the types both use rollout_types.py; how routing,
re-sending and continuation behave is docs/rollout.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from vime.supervisor.protocol import Event
from vime.supervisor.states import SYNC_RULE, VersionRule, WeightsMode

from .continuation import STALE_PREFIX, Continuation, continuation_blocker, continuation_sampling, continuation_seed
from .rollout_types import (SPAN_BRACKET, SPAN_LISTED, SPAN_READ, SPAN_SENT, UNREAD, Answer, Engine, Partial,
                            RolloutStats, Split, StartOver, answer_tokens, engine_label, piece_version)

__all__ = [
    "RolloutClient", "RolloutResult", "RolloutStats", "Attempt", "Engine", "Split", "StartOver", "Progress",
    "continuation_blocker", "continuation_sampling", "continuation_seed",
    "RolloutError", "NoEngineAvailable", "RolloutRequestError", "RolloutFailed",
    "RolloutResponseTooLarge", "StaleSample", "classify_status", "MAX_LINE_BYTES", "STALE_SAMPLES", "KEPT",
    "SPAN_READ", "SPAN_BRACKET", "SPAN_SENT", "SPAN_LISTED",
]

log = logging.getLogger("vime.rollout")

# Outcomes of one attempt (Attempt.outcome).
OK = "ok"
ABORT = "abort"          # 200 with finish_reason "abort": the engine was paused; re-sent, not reported
REFUSED = "refused"      # connection refused / could not connect: nothing was sent
DIED = "died"            # connection reset or closed mid-answer, or a stream without a finish reason
TIMEOUT = "timeout"      # no complete answer within request_timeout
SERVER_ERROR = "server_error"  # HTTP 5xx, or an error event inside the stream
BUSY = "busy"            # HTTP 429: retried elsewhere, not reported
BAD_REQUEST = "bad_request"    # HTTP 4xx: not retried
MALFORMED = "malformed"  # a stream line that is not JSON, a chunk of the wrong shape, broken HTTP
TOO_LARGE = "too_large"  # a streamed line over max_line_bytes: not retried, not reported
NO_TEXT = "no_text"      # answered, but the text across a split could not be built (/detokenize): started over
STALE = "stale"          # answered, but a token is older than max_staleness (async mode): not returned as useful
KEPT = "kept"            # the stream went on past an in-flight update in keep mode: the next piece is mixed (kv_version)

# What the client does with a sample past the staleness bound (async mode): start it over from
# its prompt on the engines the rule allows now, or raise StaleSample (the caller drops it).
STALE_SAMPLES = ("regenerate", "drop")

REPORTED = frozenset({REFUSED, DIED, TIMEOUT, SERVER_ERROR, MALFORMED})

# Longest streamed (SSE) line accepted by default. vLLM's first chunk carries every prompt
# token id (~8 bytes each with the JSON around them): 64 MiB is ~8M tokens, far past any
# context length, and still a bound on what one answer may make this process hold.
MAX_LINE_BYTES = 64 << 20

# A piece's version is read from the engine's GET /weight_info before its attempt is sent and
# after its stream ends (rollout_types.piece_version). Reads of one engine are shared: a read
# begun this many seconds before a send still bounds it from below (versions only grow), so a
# burst of requests costs one read, not one each.
VERSION_READ_SHARED_S = 0.25


class Attempt(NamedTuple):
    """One attempt of a logical request: which engine, and how it ended."""

    engine: str
    outcome: str


class Progress(NamedTuple):
    """What one request in flight holds: the engine of its current attempt, the output tokens
    received so far (the continued prefix included) and how many of them the prefix is."""

    engine: str
    tokens: int
    prefix: int


@dataclass
class RolloutResult:
    """The one answer to a logical request (never a partial or aborted one)."""

    request_id: str
    text: str
    finish_reason: str
    engine: str                      # the engine that produced this answer
    url: str
    token_ids: list[int] | None      # generated token ids (None if the server did not send them)
    logprobs: list[float] | None     # logprob of each generated token (None unless requested)
    prompt_token_ids: list[int] | None
    n_tokens: int                    # generated tokens (usage.completion_tokens, else len(token_ids))
    attempts: list[Attempt]          # every attempt, in order; the last one is (engine, "ok")
    sent: float                      # wall clock: the logical request's first attempt was sent
    attempt_sent: float              # wall clock: the successful attempt was sent
    first_token: float | None        # wall clock: its first generated token arrived
    finished: float                  # wall clock: its last chunk arrived
    epoch: int | None                # membership epoch the successful attempt was routed under
    weight_version: Any = None       # the engine's weight version as the daemon listed it
    # The sample's pieces, in order (one when it was not continued; empty when made by hand),
    # and the partial outputs thrown away before it (each with why).
    splits: list[Split] = field(default_factory=list)
    started_over: list[StartOver] = field(default_factory=list)

    @property
    def latency(self) -> float:
        """Seconds from the first send to the answer, retries included."""
        return self.finished - self.sent

    @property
    def ttft(self) -> float | None:
        """Seconds from the successful attempt's send to its first token."""
        return None if self.first_token is None else self.first_token - self.attempt_sent

    @property
    def retries(self) -> int:
        return len(self.attempts) - 1

    @property
    def continued(self) -> bool:
        """The sample was made of more than one attempt's tokens."""
        return any(s.outcome != KEPT for s in self.splits[:-1])

    @property
    def tokens_reused(self) -> int:
        """Output tokens received before a fault and kept (every piece but the last, but those a
        keep-mode update split off the same stream)."""
        return sum(s.tokens for s in self.splits[:-1] if s.outcome != KEPT)

    @property
    def tokens_regenerated(self) -> int:
        """Output tokens received before a fault and thrown away (generated again)."""
        return sum(x.tokens for x in self.started_over) + sum(s.dropped for s in self.splits)

    @property
    def tokens_before_fault(self) -> int:
        """Output tokens that attempts which then failed had streamed: reused + regenerated."""
        return self.tokens_reused + self.tokens_regenerated


# -- errors ---------------------------------------------------------------------------------


class RolloutError(Exception):
    """A logical request failed; `attempts` lists what was tried."""

    def __init__(self, message: str, *, request_id: str | None = None, attempts: Sequence[Attempt] = ()):
        super().__init__(message)
        self.request_id = request_id
        self.attempts = list(attempts)


# How long a cut request (async mode) whose only engines left all failed it, and are all still
# listed, waits for the daemon to take one out of routing: a spawned engine's death is seen on
# its pidfd at once, an attached one's at its next probe (an interval of 10 s at slime's defaults).
ORPHAN_GRACE_S = 15.0


class NoEngineAvailable(RolloutError):
    """No routable engine is left that has not already failed this request."""


class RolloutRequestError(RolloutError):
    """The engine refused the request itself (HTTP 4xx): fix the request; it is not retried."""

    def __init__(self, message: str, *, status: int, engine: str, request_id: str | None = None,
                 attempts: Sequence[Attempt] = ()):
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.status = status
        self.engine = engine


class RolloutFailed(RolloutError):
    """Every one of `max_attempts` attempts failed."""


class StaleSample(RolloutError):
    """Async mode with stale_samples="drop": the sample's oldest token was more than
    max_staleness versions behind the current one when it was answered (or when its cut
    request would have been continued); `splits` its pieces."""

    def __init__(self, message: str, *, splits: Sequence[Split], request_id: str | None = None,
                 attempts: Sequence[Attempt] = ()):
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.splits = list(splits)


class RolloutResponseTooLarge(RolloutError):
    """One streamed line of the answer was longer than `max_line_bytes`: not retried (another
    engine would send the same line) and not reported (the engine is not at fault)."""

    def __init__(self, message: str, *, engine: str, limit: int, request_id: str | None = None,
                 attempts: Sequence[Attempt] = ()):
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.engine = engine
        self.limit = limit


class _LineTooLong(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


async def _sse_lines(content: Any, max_line: int):
    """The lines (without their b"\n") of a streamed body, read in whatever pieces arrive
    (`content.iter_any()`), so no line limit but ours applies: `_LineTooLong` once a line
    passes `max_line` bytes (found while it is read, not after). A last line without a
    newline is yielded too."""
    parts: list[bytes] = []
    size = 0
    async for data in content.iter_any():
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                if start < len(data):
                    size += len(data) - start
                    if size > max_line:
                        raise _LineTooLong(size)
                    parts.append(data[start:] if start else data)
                break
            if size + (nl - start) > max_line:
                raise _LineTooLong(size + nl - start)
            if parts:
                parts.append(data[start:nl])
                line = b"".join(parts)
                parts, size = [], 0
            else:
                line = data[start:nl]
            start = nl + 1
            yield line
    if parts:
        yield b"".join(parts)


class _VersionRead:
    """One /weight_info read of an engine: when it began (None: queued behind the one in flight)."""

    started: float | None = None
    future: asyncio.Future


class _Retry(Exception):
    """One attempt failed in a way another attempt may fix."""

    def __init__(self, outcome: str, detail: str):
        super().__init__(f"{outcome}: {detail}")
        self.outcome = outcome
        self.detail = detail


def classify_status(status: int) -> str:
    """What an HTTP status means for a rollout attempt: OK, BUSY (429, retried, not reported),
    BAD_REQUEST (other 4xx, not retried) or SERVER_ERROR (5xx, retried and reported)."""
    if status < 300:
        return OK
    if status == 429:
        return BUSY
    if status < 500:
        return BAD_REQUEST
    return SERVER_ERROR


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(err)[:500]
    return str(data)[:500]


def _refusal(engine: Engine, status: int, message: str, rid: str, attempts: list[Attempt]) -> Exception:
    """What an answer other than 200 raises: RolloutRequestError for a 4xx (not retried; the
    attempt noted), else _Retry."""
    outcome = classify_status(status)
    if outcome == BAD_REQUEST:
        attempts.append(Attempt(engine.name, BAD_REQUEST))
        return RolloutRequestError(f"{engine.name} refused request {rid} with HTTP {status}: {message}",
                                   status=status, engine=engine.name, request_id=rid, attempts=attempts)
    return _Retry(outcome, f"HTTP {status} from {engine.name}: {message}")


def _take_chunk(engine: Engine, data: bytes, rid: str, attempts: list[Attempt], answer: Answer, chat: bool) -> None:
    """One streamed chunk (a data: line's JSON) into `answer`; a chunk that is not JSON, not an
    object, of the wrong shape or an error is a _Retry (a 4xx error: RolloutRequestError)."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise _Retry(MALFORMED, f"{engine.name} sent a chunk that is not JSON: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise _Retry(MALFORMED, f"{engine.name} sent a chunk that is not an object: {data[:200]!r}")
    if "error" in chunk:
        message = _error_message(data)
        code = chunk["error"].get("code") if isinstance(chunk["error"], dict) else None
        if isinstance(code, int) and 400 <= code < 500 and code != 429:
            attempts.append(Attempt(engine.name, BAD_REQUEST))
            raise RolloutRequestError(f"{engine.name} refused request {rid} mid-stream ({code}): {message}",
                                      status=code, engine=engine.name, request_id=rid, attempts=attempts)
        raise _Retry(SERVER_ERROR, f"{engine.name} sent an error mid-stream: {message}")
    try:
        answer.add(chunk, chat)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
        raise _Retry(MALFORMED, f"{engine.name} sent a chunk of the wrong shape "
                                f"({type(e).__name__}: {e}): {data[:200]!r}") from None


def _check_end(engine: Engine, answer: Answer) -> None:
    """A stream that ended without a finish reason, or with "abort", is a _Retry."""
    if answer.finish_reason is None and answer.done:
        # vLLM (0.32) drops the "abort" chunk of a request aborted before its first
        # token (an empty chunk) and ends the stream cleanly: usage, then [DONE].
        raise _Retry(ABORT, f"{engine.name} ended the stream without a finish reason "
                            f"after {len(answer.token_ids or answer.text)} token(s) (aborted while queued)")
    if answer.finish_reason is None:
        raise _Retry(DIED, f"{engine.name}'s stream ended without a finish reason or [DONE]")
    if answer.finish_reason == "abort":
        raise _Retry(ABORT, f"{engine.name} aborted the request (paused)")


# -- the client -----------------------------------------------------------------------------


class RolloutClient(Continuation):
    """Async rollout client over the daemon's routable engines (see the module docstring).

    supervisor: an AsyncSupervisorClient (or anything with async `routable_engines()`,
        `report_failure(name, detail)` and, with follow_events, `events()`).
    max_attempts: attempts per logical request, the first included.
    request_timeout: seconds one attempt may take from send to its last chunk.
    connect_timeout: seconds to open the connection to an engine.
    refresh_interval: seconds between membership reads even when nothing failed.
    max_concurrency: default bound on requests in flight in `gather`.
    backoff_initial, backoff_max: jittered exponential wait between attempts
        (tenacity wait_random_exponential(multiplier=backoff_initial, max=backoff_max)).
    cooldown: seconds an engine that just failed or aborted a request is a last resort, and
        the window in which failure reports for one engine are coalesced.
    model: the model name to send; default each engine's `model` as the daemon lists it.
    follow_events: follow the daemon's event stream for membership changes.
    max_line_bytes: longest streamed line accepted (default 64 MiB); a longer one ends the
        request with RolloutResponseTooLarge.
    api_key: the engines' API key (vLLM's --api-key / VLLM_API_KEY), sent as
        `Authorization: Bearer KEY`; default $VIME_ENGINE_API_KEY, none when that is unset.
    continue_partial: continue a request cut after tokens were streamed from those tokens
        (default), instead of starting it over (see the module docstring).
    stale_samples: async mode ([weights] mode = "async", read from the daemon's routable
        answer): a sample with a token more than max_staleness versions behind the current one
        when it is answered is not returned as useful: "regenerate" (default) starts it over
        from its prompt (counted in stats.stale_samples and tokens_regenerated), "drop" raises
        StaleSample. Its pieces' versions never decrease (a continuation goes to an engine at
        the last piece's version or newer), so its oldest token is in its first piece and no
        prefix of it is within the bound: continuing would regenerate the same tokens.
    """

    def __init__(self, supervisor: Any, *, max_attempts: int = 4, request_timeout: float = 300.0,
                 connect_timeout: float = 5.0, refresh_interval: float = 5.0, max_concurrency: int = 64,
                 backoff_initial: float = 0.05, backoff_max: float = 2.0, cooldown: float = 1.0,
                 model: str | None = None, follow_events: bool = True, return_token_ids: bool = True,
                 max_line_bytes: int = MAX_LINE_BYTES, api_key: str | None = None,
                 continue_partial: bool = True, stale_samples: str = "regenerate"):
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if stale_samples not in STALE_SAMPLES:
            raise ValueError(f"stale_samples must be one of {', '.join(STALE_SAMPLES)}, got {stale_samples!r}")
        self.stale_samples = stale_samples
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be >= 1")
        self.max_line_bytes = max_line_bytes
        self.supervisor = supervisor
        self.max_attempts = max_attempts
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.refresh_interval = refresh_interval
        self.max_concurrency = max_concurrency
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.cooldown = cooldown
        self.model = model
        self.follow_events = follow_events
        self.return_token_ids = return_token_ids
        self.continue_partial = continue_partial
        key = api_key if api_key is not None else os.environ.get("VIME_ENGINE_API_KEY")
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}

        self.stats = RolloutStats()
        self.engines: list[Engine] = []
        self.epoch: int | None = None
        self.weight_version: Any = None
        self.rule: VersionRule = SYNC_RULE  # the daemon's routing rule, from its routable answer
        # An in-flight update (trainer/inflight.py): engines being updated take no attempt, and
        # those it verified at a newer version than the daemon lists yet are listed at it.
        self._held: set[str] = set()
        self._verified: dict[tuple[str, int | None], int] = {}  # (engine, incarnation) -> version
        self._kept: dict[str, list[tuple[int, int]]] = {}  # request id -> (output tokens, version) where a keep went on
        # Every failure report and the daemon's answer (or the error): (engine, detail, answer).
        self.reports: collections.deque[tuple[str, str, Any]] = collections.deque(maxlen=1000)
        self._outstanding: dict[str, int] = collections.defaultdict(int)
        self._cool_until: dict[str, float] = {}
        self._reported_at: dict[str, float] = {}
        self._rr = itertools.count()
        self._refresh_lock = asyncio.Lock()
        self._last_refresh_started = float("-inf")
        self._session: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._report_tasks: set[asyncio.Task] = set()
        self._progress: dict[str, tuple[str, Answer, int]] = {}  # request id -> (engine, answer, prefix)
        # The /weight_info reads of each (engine, incarnation): the last begun, and the next.
        self._version_reads: dict[tuple[str, int | None], list[_VersionRead]] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> "RolloutClient":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the HTTP session, read membership once (raises if the daemon is unreachable)
        and start the background refresher (and event follower)."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout, sock_connect=self.connect_timeout),
                trust_env=False,
            )
        await self.refresh(force=True)
        self._spawn(self._refresh_loop())
        if self.follow_events and hasattr(self.supervisor, "events"):
            self._spawn(self._follow_events())

    async def aclose(self) -> None:
        """Stop the background tasks, let pending failure reports finish (up to 5 s), close."""
        for t in list(self._tasks) + [r.future for rs in self._version_reads.values() for r in rs]:
            t.cancel()
        self._version_reads.clear()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._report_tasks:
            await asyncio.wait(list(self._report_tasks), timeout=5.0)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- membership ------------------------------------------------------------------------

    async def refresh(self, *, force: bool = False) -> None:
        """Read the routable engines and epoch from the daemon. Concurrent callers share one
        read: a call returns once a read that began after it was made has finished. If the
        daemon cannot be reached, the last known membership is kept (unless force)."""
        asked = time.monotonic()
        async with self._refresh_lock:
            if self._last_refresh_started >= asked:
                return
            self._last_refresh_started = time.monotonic()
            try:
                view = await self.supervisor.routable_engines()
            except Exception as e:
                self.stats.refresh_errors += 1
                if force:
                    raise
                log.warning("rollout: could not read routable engines (keeping epoch %s): %s", self.epoch, e)
                return
            self.stats.refreshes += 1
            self._apply(view)

    def _apply(self, view: Mapping[str, Any]) -> None:
        engines = [Engine(name=e["name"], url=str(e["url"]).rstrip("/"), model=e.get("model"),
                          weight_version=self._newest(e), incarnation=e.get("incarnation"))
                   for e in view.get("engines") or ()]
        if view.get("epoch") != self.epoch:
            log.info("rollout: membership epoch %s -> %s: %s", self.epoch, view.get("epoch"),
                     [e.name for e in engines])
        listed = {e.name: e.weight_version for e in self.engines}
        # A publish, or an engine listed at another version: a read from before it would bound
        # a new piece loosely.
        if view.get("weight_version") != self.weight_version:
            self._version_reads.clear()
        self._forget_versions(e.name for e in engines if e.name in listed and listed[e.name] != e.weight_version)
        self.engines = engines
        self.epoch = view.get("epoch")
        self.weight_version = view.get("weight_version")
        self.rule = VersionRule.from_answer(view)

    # -- in-flight updates (trainer/inflight.py) ---------------------------------------------

    def _newest(self, entry: Mapping[str, Any]) -> Any:
        """A listed engine's version, or the newer one an in-flight update verified it at
        (versions only grow within an incarnation; the daemon learns it at the publish)."""
        listed = entry.get("weight_version")
        known = self._verified.get((entry.get("name", ""), entry.get("incarnation")))
        return known if known is not None and (VersionRule.lag(listed, known) or 0) > 0 else listed

    def hold(self, names: Iterable[str]) -> None:
        """These engines are being updated: no attempt is sent to them until `updated` (a
        request would otherwise be served on the new weights under the old version's label)."""
        self._held.update(names)
        self._forget_versions(names)

    def updated(self, name: str, version: int) -> None:
        """`name` was verified at `version` and resumed: its next pieces are that version's,
        whatever the daemon lists until it learns it; it takes attempts again."""
        for e in self.engines:
            if e.name == name:
                self._verified[(name, e.incarnation)] = version
        self.engines = [dataclasses.replace(e, weight_version=version) if e.name == name else e for e in self.engines]
        self._held.discard(name)
        self._forget_versions([name])

    def _forget_versions(self, names: Iterable[str]) -> None:
        names = set(names)
        for key in [k for k in self._version_reads if k[0] in names]:
            del self._version_reads[key]

    def kept(self, name: str, version: int, read: Mapping[str, int]) -> None:
        """`name` resumes its requests on `version`'s weights over the KV cache its old weights
        computed (`/pause?mode=keep`): of each request in `read` (request id -> output tokens
        read when the engine froze) still streaming from it, the tokens after those are
        `version`'s over mixed KV, and its pieces say so (Split.kv_version)."""
        for rid, at in read.items():
            held = self._progress.get(rid)
            if held is not None and held[0] == name:
                self._kept.setdefault(rid, []).append((at, version))

    def _kept_pieces(self, rid: str, piece: Split) -> list[Split]:
        """An attempt's piece, split where keep-mode updates went on under it: each later piece
        at the update's version, with the attempt's version as its kv_version."""
        end = piece.offset + piece.tokens
        marks = [(at, v) for at, v in self._kept.pop(rid, ()) if at < end]  # none made after a mark past the end
        if not marks:
            return [piece]
        # Each mark is the update's own read of the engine (/weight_info said `new` before it
        # resumed): the pieces between marks are exact (the first: as its version was known,
        # read or listed). The last is exact only where a read after its stream saw the same;
        # a newer read keeps the bracket; a cut piece (no read after) has the mark's read as
        # its only bound (span sent, bounded by the listing: _listing_bound).
        out, start, version, kv = [], piece.offset, piece.weight_version, None
        span = SPAN_LISTED if piece.span == SPAN_LISTED else SPAN_READ
        for at, new in marks:
            at = min(max(at, start), end)
            if at > start:
                out.append(piece._replace(weight_version=version, offset=start, tokens=at - start, outcome=KEPT,
                                          dropped=0, kv_version=kv, span=span, weight_version_end=None))
            start, version, kv, span = at, new, piece.weight_version, SPAN_READ
        if piece.span == SPAN_BRACKET and piece.weight_version_end != version:
            last_span, last_end = SPAN_BRACKET, piece.weight_version_end
        else:
            last_span, last_end = (SPAN_READ if piece.span in (SPAN_READ, SPAN_BRACKET) else SPAN_SENT), None
        out.append(piece._replace(weight_version=version, offset=start, tokens=end - start, kv_version=kv,
                                  span=last_span, weight_version_end=last_end))
        return out

    def released(self, name: str) -> None:
        """An update of `name` ended without a new version (failed): it takes attempts again at
        the version it is listed at."""
        self._held.discard(name)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            if time.monotonic() - self._last_refresh_started >= self.refresh_interval * 0.5:
                await self.refresh()

    async def _follow_events(self) -> None:
        """Membership events drop engines at once and trigger a read of the new set."""
        while True:
            try:
                async with contextlib.aclosing(self.supervisor.events()) as stream:
                    async for ev in stream:
                        kind = ev.get("event")
                        if kind == Event.MEMBERSHIP and ev.get("epoch") != self.epoch:
                            names = set(ev.get("routable") or ())
                            self.engines = [e for e in self.engines if e.name in names]
                            await self.refresh()
                        elif kind in (Event.HELLO, Event.RECONNECTED, Event.WEIGHTS_PUBLISHED):
                            # A publish in async mode may leave the set as it was: the
                            # current version (the staleness bound's reference) is read anew.
                            await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the daemon is away: the refresher keeps the last set
                log.debug("rollout: event stream ended: %s", e)
            await asyncio.sleep(1.0)

    def outstanding(self) -> dict[str, int]:
        """Requests in flight from this client, per engine."""
        return {k: v for k, v in self._outstanding.items() if v}

    def progress(self) -> dict[str, Progress]:
        """Requests with an attempt in flight: request id -> Progress (engine, output tokens
        received so far, the continued prefix's share of them). Read-only, a snapshot: what
        this client has read from the streams, not what the engines have generated."""
        return {rid: Progress(name, prefix + answer_tokens(answer), prefix)
                for rid, (name, answer, prefix) in list(self._progress.items())}

    def pick(self, exclude: Iterable[str] = (), avoid: Iterable[str] = ()) -> Engine | None:
        """The engine for the next attempt: never one in `exclude` (it failed this request);
        one in `avoid` (it aborted this request) or cooling down only when nothing else is
        left; then the fewest outstanding requests, ties in round robin."""
        exclude, avoid = set(exclude) | self._held, set(avoid)
        now = time.monotonic()
        cands = [e for e in self.engines if e.name not in exclude]
        if not cands:
            return None
        pool = ([e for e in cands if e.name not in avoid and self._cool_until.get(e.name, 0) <= now]
                or [e for e in cands if e.name not in avoid] or cands)
        least = min(self._outstanding[e.name] for e in pool)
        tied = [e for e in pool if self._outstanding[e.name] == least]
        return tied[next(self._rr) % len(tied)]

    # -- failure reports -------------------------------------------------------------------

    def _report(self, engine: str, detail: str, incarnation: int | None = None) -> None:
        now = time.monotonic()
        if now - self._reported_at.get(engine, float("-inf")) < self.cooldown:
            self.stats.reports_coalesced += 1
            return
        self._reported_at[engine] = now
        task = asyncio.get_running_loop().create_task(self._send_report(engine, detail, incarnation))
        self._report_tasks.add(task)
        task.add_done_callback(self._report_tasks.discard)

    async def _send_report(self, engine: str, detail: str, incarnation: int | None) -> None:
        # With the incarnation the failure was seen on, a late report cannot count against
        # the engine's next process (the daemon ignores it and says so).
        extra = {} if incarnation is None else {"incarnation": incarnation}
        try:
            answer = await self.supervisor.report_failure(engine, detail, **extra)
        except Exception as e:  # best effort: the daemon also sees deaths and hangs itself
            self.stats.report_errors += 1
            self.reports.append((engine, detail, e))
            log.warning("rollout: failure report for %s did not reach the daemon: %s", engine, e)
            return
        self.stats.reported += 1
        self.reports.append((engine, detail, answer))

    # -- requests --------------------------------------------------------------------------

    async def complete(self, prompt: str | list[int], **sampling: Any) -> RolloutResult:
        """POST /v1/completions (streamed) with `prompt` and the sampling parameters as given
        (max_tokens, temperature, top_p, seed, logprobs, ignore_eos, stop, ...)."""
        return await self._request("/v1/completions", {"prompt": prompt}, sampling, chat=False)

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> RolloutResult:
        """POST /v1/chat/completions (streamed) with `messages` and the sampling parameters."""
        return await self._request("/v1/chat/completions", {"messages": messages}, sampling, chat=True)

    async def gather(self, prompts: Sequence[str | list[dict[str, Any]]], *, concurrency: int | None = None,
                     return_exceptions: bool = False, **sampling: Any) -> list[Any]:
        """Run a batch, at most `concurrency` (default max_concurrency) in flight; results in
        the prompts' order. A str is a completion prompt, a list of messages a chat. On the
        first error the rest are cancelled and it is raised, unless return_exceptions (then
        each failed request's place holds its exception)."""
        sem = asyncio.Semaphore(concurrency or self.max_concurrency)

        async def one(p: Any) -> RolloutResult:
            async with sem:
                if isinstance(p, str):
                    return await self.complete(p, **sampling)
                return await self.chat(list(p), **sampling)

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        if not tasks:
            return []
        if return_exceptions:
            return list(await asyncio.gather(*tasks, return_exceptions=True))
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _request(self, path: str, payload: dict[str, Any], sampling: dict[str, Any], *, chat: bool
                       ) -> RolloutResult:
        if self._session is None:
            raise RuntimeError("RolloutClient is not started: use `async with RolloutClient(...)`")
        for key, allowed in (("n", 1), ("best_of", 1), ("stream", True), ("echo", False)):
            if key in sampling and sampling[key] not in (allowed, None):
                raise ValueError(f"{key}={sampling[key]!r} is not supported: one streamed choice per request, "
                                 "generated text only (the prompt's token ids are in prompt_token_ids)")
        rid = f"rollout-{uuid.uuid4().hex[:16]}"
        self.stats.requests += 1
        attempts: list[Attempt] = []
        failed: set[str] = set()
        aborted: set[str] = set()
        sent = time.time()
        state = Partial()
        state.blocker = continuation_blocker(sampling, chat)
        limit = sampling.get("max_completion_tokens") if chat else None
        state.limit = sampling.get("max_tokens") if limit is None else limit
        state.want_logprobs = sampling.get("logprobs") not in (None, False)
        state.keep_stop = bool(sampling.get("include_stop_str_in_output"))
        try:
            retrying = AsyncRetrying(
                stop=stop_after_attempt(self.max_attempts),
                wait=wait_random_exponential(multiplier=self.backoff_initial, max=self.backoff_max),
                retry=retry_if_exception_type(_Retry),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    engine = await self._choose(rid, failed, aborted, attempts, state)
                    if state.token_ids:
                        await self._split_between_characters(rid, engine, state)
                    if state.token_ids:  # a continuation: a completion on the token ids so far
                        assert state.prompt_token_ids is not None  # set with its first piece
                        self.stats.continued += 1
                        log.info("rollout: %s: continuing on %s after %d token(s)", rid, engine.name, len(state))
                        result = await self._attempt(
                            engine, "/v1/completions", {"prompt": state.prompt_token_ids + state.token_ids},
                            continuation_sampling(sampling, len(state), chat), False, rid, attempts, failed,
                            aborted, sent, state)
                    else:
                        result = await self._attempt(engine, path, payload, sampling, chat, rid, attempts,
                                                     failed, aborted, sent, state)
        except _Retry as last:
            self.stats.failed += 1
            tried = ", ".join(f"{a.engine}: {a.outcome}" for a in attempts)
            raise RolloutFailed(f"request {rid} failed {len(attempts)} attempt(s) (max_attempts="
                                f"{self.max_attempts}): {tried}; last: {last.detail}",
                                request_id=rid, attempts=attempts) from None
        except BaseException:
            self.stats.failed += 1
            raise
        self.stats.succeeded += 1
        return result

    async def _choose(self, rid: str, failed: set[str], aborted: set[str], attempts: list[Attempt],
                      state: Partial) -> Engine:
        why = None
        self._restarted(failed, state)
        if state.token_ids:
            engine, why = await self._continuation_engine(failed, aborted, state)
            if engine is not None:
                self.stats.retried += 1
                return engine
            if why.startswith(STALE_PREFIX):
                self._stale(rid, state, why, attempts, 0)  # counted; raised when dropping
        # A new generation (a first attempt, or one started over): admitted only where it can
        # finish inside the bound (_late).
        continuing = why is not None and bool(why) and not why.startswith(STALE_PREFIX)
        engine = self.pick(failed | self._late(), aborted)
        if engine is None:
            await self.refresh()  # the daemon may list engines we do not know of yet
            self._restarted(failed, state)
            # One it lists now (a spare promoted in a dead engine's place, a restart) may continue
            # the cut request: tried before starting over on it.
            if continuing:
                engine, stale = self._continue_after_a_read(rid, state, failed, aborted, attempts)
                if engine is not None:
                    self.stats.retried += 1
                    return engine
                if stale:
                    why, continuing = stale, False
            engine = self.pick(failed | self._late(), aborted)
        waiting_since = time.monotonic()
        deadline = waiting_since + self.request_timeout
        held_since = None
        while engine is None and time.monotonic() < deadline:
            late = self._late() - failed
            # Async mode: a cut request with no engine left to go to waits for the daemon to
            # list one (with no rounds it restarts or promotes a spare at once): starting over
            # would need one too. In sync mode a round may be what the restart waits for.
            orphaned = self._orphaned(continuing, failed, time.monotonic() - waiting_since)
            if not (self._held or late or orphaned):
                break
            if late and held_since is None:
                held_since = time.monotonic()
                self.stats.held_at_admission += 1
                log.info("rollout: %s: held at admission: %s would be past max_staleness after the next "
                         "publish", rid, ", ".join(sorted(late)))
            # Every engine left is being updated, or too far behind to start on: wait for one
            # (an orphaned request alone waits for a listing, read on the daemon's events: a
            # slower poll, as many requests may wait at once).
            await asyncio.sleep(0.01 if self._held or late else 0.1)
            self._restarted(failed, state)
            if continuing:
                # A cut request waiting here had no engine to continue on: an update or a
                # publish that moves one up to its tokens' version continues it (nothing is
                # regenerated).
                engine, stale = self._continue_after_a_read(rid, state, failed, aborted, attempts)
                if engine is not None:
                    why = ""
                    break
                if stale:
                    why, continuing = stale, False
            engine = self.pick(failed | self._late(), aborted)
        if held_since is not None:
            self.stats.admission_wait_ms += int((time.monotonic() - held_since) * 1000)
        if engine is None:
            listed = ", ".join(e.name for e in self.engines) or "none"
            tried = ", ".join(f"{a.engine} ({a.outcome})" for a in attempts) or "none"
            late = self._late() - failed
            refused = (f"; {', '.join(sorted(late))} not admitted in {self.request_timeout:g}s: a sample started "
                       f"there would be past max_staleness after the next publish" if late else "")
            if self._orphaned(continuing, failed, 0.0):
                refused += (f"; no other engine listed in {time.monotonic() - waiting_since:.3g}s (failed this "
                            f"request: {', '.join(sorted(failed))})")
            raise NoEngineAvailable(
                f"no engine left for request {rid}: tried {len(set(a.engine for a in attempts))} engine(s) "
                f"in {len(attempts)} attempt(s) [{tried}]; the daemon lists {len(self.engines)} routable "
                f"engine(s) at epoch {self.epoch} [{listed}]{refused}{'; not continued: ' + why if why else ''}. "
                f"Check `supervisorctl status`",
                request_id=rid, attempts=attempts)
        if why:  # an engine to start over on (with none at all, nothing is regenerated)
            self._start_over(rid, state, why)
        if attempts:
            self.stats.retried += 1
        return engine

    def _continue_after_a_read(self, rid: str, state: Partial, failed: set[str], aborted: set[str],
                               attempts: list[Attempt]) -> tuple[Engine | None, str | None]:
        """A cut request waiting for an engine, after the listing or the version moved: (an engine
        listed now that may continue it, None), or (None, why) when the current version took its
        tokens past the bound (counted; raised when dropping), or (None, None)."""
        if self._stale_pieces(state.splits):
            why = self._stale_prefix_why(state)
            self._stale(rid, state, why, attempts, 0)
            return None, why
        return self._continuation_pick(failed, aborted, state), None

    def _restarted(self, failed: set[str], state: Partial) -> None:
        """An engine that failed this request and is listed now as another incarnation (the
        daemon restarted it under the same name) is a new process: it may take the request."""
        for e in self.engines:
            if e.name in failed and e.name in state.failed_on and e.incarnation != state.failed_on[e.name]:
                failed.discard(e.name)

    def _orphaned(self, continuing: bool, failed: set[str], waited: float) -> bool:
        """Whether a cut request (async mode) with no listed engine that has not failed it waits
        for one: while the daemon has taken one of those out of routing (it restarts it or
        promotes a spare at once), else for ORPHAN_GRACE_S (the daemon may not have seen the
        death yet; one still listed after that is alive and failed the request otherwise)."""
        listed = {e.name for e in self.engines}
        if not continuing or self.rule.mode is not WeightsMode.ASYNC or listed - failed:
            return False
        return bool(failed - listed) or waited < ORPHAN_GRACE_S

    def _late(self) -> set[str]:
        """Admission (async mode): the routable engines a new generation must not start on. A
        sample's tokens must stay within max_staleness of the current version until it is
        returned; one started on an engine whose version would be past the bound once one
        more version is published is stale by then, however short it is meant to be (with
        max_staleness 1: every engine behind the current version). An engine at the current
        version or newer is never late: no newer weights exist to wait for."""
        current = self.weight_version
        if self.rule.mode is not WeightsMode.ASYNC or not isinstance(current, int) or isinstance(current, bool):
            return set()
        late = set()
        for e in self.engines:
            lag = VersionRule.lag(e.weight_version, current)
            if (lag is None or lag > 0) and self.rule.too_old(e.weight_version, current + 1):
                late.add(e.name)
        return late

    def _stale(self, rid: str, state: Partial, why: str, attempts: list[Attempt], extra: int,
               last: Split | None = None) -> None:
        """Count a sample (its `state` and `extra` tokens, its last piece `last`) not returned as
        useful for staleness; with stale_samples="drop", raise it as StaleSample."""
        tokens = len(state) + extra
        self.stats.stale_samples += 1
        self.stats.stale_tokens += tokens
        if self.stale_samples == "drop":
            self.stats.stale_dropped_tokens += tokens
            splits = state.splits + ([last] if last is not None else [])
            log.info("rollout: %s: dropped: %s", rid, why)
            raise StaleSample(f"request {rid}: {why}", splits=splits, request_id=rid, attempts=attempts)

    async def _engine_version(self, engine: Engine, since: float) -> Any:
        """The engine's weight version (engine_label) from a /weight_info read begun at or after
        `since` (time.monotonic()); UNREAD when none answered. One read of an engine at a time:
        a caller joins one begun since `since` or waiting to begin, else queues the next (it
        begins when the one in flight ends), so requests ending together share reads."""
        key = (engine.name, engine.incarnation)
        reads = self._version_reads.get(key, [])
        for r in reversed(reads):
            if r.started is None or r.started >= since:
                return await asyncio.shield(r.future)
        ahead = reads[-1].future if reads and not reads[-1].future.done() else None
        read = _VersionRead()
        read.future = asyncio.ensure_future(self._read_after(ahead, engine, read))
        self._version_reads[key] = reads[-1:] + [read]
        return await asyncio.shield(read.future)

    async def _read_after(self, ahead: asyncio.Future | None, engine: Engine, read: "_VersionRead") -> Any:
        if ahead is not None:
            await asyncio.wait([ahead])
        read.started = time.monotonic()
        return await self._read_weight_info(engine)

    async def _read_weight_info(self, engine: Engine) -> Any:
        import aiohttp

        try:
            async with self._session.get(f"{engine.url}/weight_info", headers=self._auth,
                                         timeout=aiohttp.ClientTimeout(total=self.connect_timeout)) as resp:
                if resp.status != 200:
                    return UNREAD  # not served (vLLM serves it in dev mode): the listing stands in
                body = await resp.json(content_type=None)
        except Exception as e:  # noqa: BLE001 - no answer says nothing of the weights
            log.debug("rollout: /weight_info on %s: %s", engine.name, e)
            return UNREAD
        return engine_label(body.get("weight_version")) if isinstance(body, dict) else UNREAD

    async def _made_on(self, engine: Engine, before: Any, answer: Answer, outcome: str) -> tuple[Any, str, Any]:
        """A piece's (weight_version, span, weight_version_end): the engine's own label read
        before the attempt and, where the engine answered it in full, read again now
        (piece_version). Not after an abort: vLLM aborts at a pause, before an update changes
        the weights, so a read now would see the update's version, not the tokens' (and wait
        for its reload). Nor after a death or a hang: a read of a hung engine would hold the
        re-send up."""
        after = UNREAD
        if answer_tokens(answer) and outcome == OK and before is not UNREAD:
            after = await self._engine_version(engine, time.monotonic())
        return piece_version(engine.weight_version, before, after)

    def _listing_bound(self, engine: Engine, pieces: list[Split]) -> list[Split]:
        """An attempt's pieces, the last one bounded by the listing: a piece known from a read
        before it only (span sent: cut, or no usable read after) may hold tokens of an update
        that went on under the request (a keep-mode pause nobody told this client of); the
        engine listed newer by now bounds them (a bracket up to it), so a continuation never
        goes back to older weights. Matched by name, not incarnation: a restarted engine's
        listing only widens the bracket, which is safe for that rule."""
        last = pieces[-1]
        listed = next((e.weight_version for e in self.engines if e.name == engine.name), None)
        if (last.span == SPAN_SENT and isinstance(listed, int) and isinstance(last.weight_version, int)
                and listed > last.weight_version):
            pieces[-1] = last._replace(span=SPAN_BRACKET, weight_version_end=listed)
        return pieces

    async def _attempt(self, engine: Engine, path: str, payload: dict[str, Any], sampling: dict[str, Any],
                       chat: bool, rid: str, attempts: list[Attempt], failed: set[str], aborted: set[str],
                       sent: float, state: Partial) -> RolloutResult:
        """One attempt of request `rid` on `engine`: its answer as the sample (with the pieces
        kept in `state`), or _Retry after noting the failure (the engine into `failed` or
        `aborted`, its tokens kept in `state`); RolloutError when it must not be retried."""
        body = self._body(engine, payload, sampling)
        epoch, published = self.epoch, self.weight_version
        self.stats.sent += 1
        self._outstanding[engine.name] += 1
        attempt_sent = time.time()
        answer = Answer()
        prefix = len(state)
        self._progress[rid] = (engine.name, answer, prefix)
        before = UNREAD
        try:
            # The engine's own version before it gets the request: with the read after the
            # stream ends, it brackets the piece (piece_version).
            before = await self._engine_version(engine, time.monotonic() - VERSION_READ_SHARED_S)
            await self._stream(engine, f"{engine.url}{path}", body, rid, attempts, answer, chat)
            _check_end(engine, answer)
        except _Retry as r:
            self._attempt_over(engine, rid)
            made_on = await self._made_on(engine, before, answer, r.outcome)
            await self._attempt_failed(engine, r, rid, attempts, state, published, answer, sampling.get("seed"),
                                       failed, aborted, made_on)
            raise
        except BaseException:
            self._attempt_over(engine, rid)
            self._kept.pop(rid, None)
            raise
        self._attempt_over(engine, rid)
        finished = time.time()
        n = answer.usage_tokens if answer.usage_tokens is not None else len(answer.token_ids or ())
        version, span, end = await self._made_on(engine, before, answer, OK)
        pieces = self._listing_bound(engine, self._kept_pieces(
            rid, Split(engine.name, version, prefix, n, OK, sampling.get("seed"), span=span, weight_version_end=end)))
        self._check_staleness(rid, engine, state, pieces[0], answer, attempts)  # the oldest: versions only grow
        text, token_ids, logprobs, prompt_ids = await self._joined(engine, rid, answer, state, attempts, aborted)
        attempts.append(Attempt(engine.name, OK))
        return RolloutResult(
            request_id=rid, text=text, finish_reason=answer.finish_reason or "",
            engine=engine.name, url=engine.url, token_ids=token_ids, logprobs=logprobs, prompt_token_ids=prompt_ids,
            n_tokens=prefix + n, attempts=list(attempts), sent=sent, attempt_sent=attempt_sent,
            first_token=answer.first_token, finished=finished, epoch=epoch, weight_version=pieces[-1].weight_version,
            splits=state.splits + pieces, started_over=list(state.started_over))

    def _check_staleness(self, rid: str, engine: Engine, state: Partial, last: Split, answer: Answer,
                         attempts: list[Attempt]) -> None:
        """Async mode, an answered sample: if a piece's version is more than max_staleness
        behind the current one (the rule's too_old), it is not returned: started over from the
        prompt (_Retry) or raised as StaleSample, as `stale_samples` says; counted either way."""
        old = self._stale_pieces(state.splits + [last])
        if not old:
            return
        why = (f"{STALE_PREFIX} tokens from {', '.join(sorted({repr(s.weight_version) for s in old}))} are more than "
               f"max_staleness ({self.rule.max_staleness}) versions behind the current {self.weight_version!r}")
        attempts.append(Attempt(engine.name, STALE))
        self._stale(rid, state, why, attempts, answer_tokens(answer), last)
        # The answer's tokens were streamed by an attempt whose sample is thrown away.
        self.stats.tokens_before_fault += answer_tokens(answer)
        self._start_over(rid, state, why, engine=engine.name, version=last.weight_version,
                         extra=answer_tokens(answer))
        raise _Retry(STALE, f"request {rid}: {why}; regenerated")

    def _body(self, engine: Engine, payload: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
        """An attempt's request body: streamed, with usage and (by default) token ids."""
        body: dict[str, Any] = {"model": self.model or engine.model, **payload}
        if self.return_token_ids:
            body["return_token_ids"] = True
        body.update(sampling)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, **(sampling.get("stream_options") or {})}
        return body

    async def _stream(self, engine: Engine, url: str, body: dict[str, Any], rid: str, attempts: list[Attempt],
                      answer: Answer, chat: bool) -> None:
        """POST the attempt and read its stream into `answer`. Whatever the engine or the HTTP
        layer does wrong is a _Retry; a refusal (4xx) or a line over max_line_bytes is a
        RolloutError, never retried."""
        import aiohttp
        from aiohttp.http_exceptions import HttpProcessingError

        try:
            async with self._session.post(url, json=body, headers={"X-Request-Id": f"{rid}-{len(attempts)}",
                                                                   **self._auth}) as resp:
                if resp.status != 200:
                    raise _refusal(engine, resp.status, _error_message(await resp.read()), rid, attempts)
                async with contextlib.aclosing(_sse_lines(resp.content, self.max_line_bytes)) as lines:
                    async for raw in lines:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            answer.done = True
                            break
                        _take_chunk(engine, data, rid, attempts, answer, chat)
        except _LineTooLong as e:
            attempts.append(Attempt(engine.name, TOO_LARGE))
            raise RolloutResponseTooLarge(
                f"{engine.name} streamed a line over {self.max_line_bytes} bytes ({e.size}+ bytes read) for "
                f"request {rid}; not re-sent: raise RolloutClient(max_line_bytes=...) if answers this "
                f"large are expected", engine=engine.name, limit=self.max_line_bytes, request_id=rid,
                attempts=attempts) from None
        except aiohttp.ClientConnectorError as e:
            raise _Retry(REFUSED, f"cannot connect to {engine.name} at {engine.url}: {e.os_error or e}") from None
        except asyncio.TimeoutError:
            raise _Retry(TIMEOUT, f"{engine.name} did not answer within {self.request_timeout:g}s") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as e:
            raise _Retry(DIED, f"{engine.name} dropped the connection: {type(e).__name__}: {e}") from None
        except (aiohttp.ClientError, HttpProcessingError) as e:
            # Anything else the HTTP layer raises (a response it cannot parse, ...) is this
            # attempt's failure, never an exception that escapes gather() for the batch.
            raise _Retry(MALFORMED, f"{engine.name} sent a response that cannot be read: "
                                    f"{type(e).__name__}: {e}"[:500]) from None

    def _attempt_over(self, engine: Engine, rid: str) -> None:
        self._outstanding[engine.name] -= 1
        self._progress.pop(rid, None)

    async def _attempt_failed(self, engine: Engine, r: _Retry, rid: str, attempts: list[Attempt], state: Partial,
                              published: Any, answer: Answer, seed: int | None, failed: set[str],
                              aborted: set[str], made_on: tuple[Any, str, Any]) -> None:
        """Note a failed attempt: its tokens kept (or thrown away) in `state` as a piece made on
        `made_on`, the failure reported, the engine excluded (or a last resort), the membership
        read again."""
        attempts.append(Attempt(engine.name, r.outcome))
        kept = len(state.splits)
        self._keep(rid, state, engine, published, answer, r.outcome, seed, made_on)
        if len(state.splits) > kept:  # this attempt's piece: split where a keep-mode update went on
            state.splits[kept:] = self._listing_bound(engine, self._kept_pieces(rid, state.splits[kept]))
        self._kept.pop(rid, None)
        self._on_failure(engine, r, rid)
        if r.outcome in (ABORT, BUSY):  # the engine is fine: a last resort, not excluded
            aborted.add(engine.name)
        else:
            failed.add(engine.name)
            state.failed_on[engine.name] = engine.incarnation
        await self.refresh()  # the epoch may have changed

    async def _joined(self, engine: Engine, rid: str, answer: Answer, state: Partial, attempts: list[Attempt],
                      aborted: set[str]) -> tuple[str, list[int] | None, list[float] | None, list[int] | None]:
        """The sample's text, token ids, logprobs and prompt ids: the answer's own, or with kept
        pieces, those pieces then this answer (whose prompt carried them) as one sample."""
        prefix = len(state)
        if not prefix:
            return "".join(answer.text), answer.token_ids, answer.logprobs, answer.prompt_token_ids
        piece = self._piece(state, answer)
        state.token_ids.extend(answer.token_ids or [])
        await self._fold(engine, state, *piece, final=True)
        built = await self._sample_text(engine, state, answer.finish_reason == "stop")
        if built is None:  # rare: /detokenize answered at the split, and no engine answers it now
            attempts.append(Attempt(engine.name, NO_TEXT))
            self.stats.tokens_before_fault += answer_tokens(answer)
            self._start_over(rid, state, "the text across a split inside a character could not be built: "
                                         "no engine answered /detokenize", engine=engine.name)
            aborted.add(engine.name)
            raise _Retry(NO_TEXT, f"no engine answered /detokenize for request {rid}'s text")
        logprobs = None if state.logprobs is None or answer.logprobs is None else state.logprobs + answer.logprobs
        self.stats.tokens_reused += prefix
        return built, list(state.token_ids), logprobs, state.prompt_token_ids

    def _on_failure(self, engine: Engine, r: _Retry, rid: str) -> None:
        self._cool_until[engine.name] = time.monotonic() + self.cooldown
        if r.outcome == ABORT:
            self.stats.aborted += 1
            log.info("rollout: %s: %s; re-sending", rid, r.detail)
            return
        if r.outcome == BUSY:
            log.info("rollout: %s: %s; re-sending", rid, r.detail)
            return
        self.stats.attempt_failures += 1
        log.warning("rollout: %s: %s; re-sending", rid, r.detail)
        if r.outcome in REPORTED:
            self._report(engine.name, f"rollout request {r.outcome}: {r.detail}"[:500], engine.incarnation)
