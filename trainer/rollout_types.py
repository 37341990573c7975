"""What the rollout client (rollout.py) and its continuation half (continuation.py) share: the
engines they route to, the client's counters, and what a sample is built of (its pieces, the
outputs thrown away, the request's output so far, one streamed answer)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from vime.supervisor.states import VersionRule

__all__ = ["Engine", "RolloutStats", "Split", "StartOver", "Partial", "Answer", "answer_tokens", "engine_label",
           "piece_version",
           "UNREAD", "SPAN_READ", "SPAN_BRACKET", "SPAN_SENT", "SPAN_LISTED"]

# Where a piece's weight version comes from (Split.span). vLLM 0.32 reports per-span versions
# only on its token-in-token-out route (/inference/v1/generate, off unless the engine runs with
# --enable-scale-out), not on /v1/completions or /v1/chat/completions, the routes this client
# streams (docs/rollout.md, "Which weights made each token"); so the engine's own label is read
# from its GET /weight_info around the piece:
SPAN_READ = "weight_info"  # read before the attempt was sent and after its stream ended: the same, so exact
SPAN_BRACKET = "bracket"   # the two reads differ: its tokens came from versions weight_version..weight_version_end
SPAN_SENT = "sent"         # read before only (a piece that was cut: aborted, died, hung): what it held when sent
SPAN_LISTED = "listed"     # no read answered (the route not served): the version the daemon listed it at
UNREAD = object()          # a /weight_info read that got no usable answer


@dataclass
class RolloutStats:
    """Counters of this client (for tests and traces). `requests` logical requests were
    started; each ends in exactly one of `succeeded` / `failed`."""

    requests: int = 0
    sent: int = 0            # attempts sent (or tried to send)
    retried: int = 0         # attempts after a logical request's first
    succeeded: int = 0
    failed: int = 0
    aborted: int = 0         # attempts answered with finish_reason "abort"
    attempt_failures: int = 0  # attempts that refused/died/timed out/5xx
    reported: int = 0        # failure reports the daemon answered
    reports_coalesced: int = 0
    report_errors: int = 0   # failure reports that did not reach the daemon
    refreshes: int = 0
    refresh_errors: int = 0
    # Continuation (see the module docstring). tokens_before_fault: output tokens streamed by
    # attempts that then failed; tokens_reused: of those, kept in a returned sample;
    # tokens_regenerated: thrown away when a request started over (so generated again). For
    # requests that all returned, tokens_before_fault == tokens_reused + tokens_regenerated;
    # the tokens of a request that raised count in the first only.
    tokens_before_fault: int = 0
    tokens_reused: int = 0
    tokens_regenerated: int = 0
    continued: int = 0       # attempts sent as continuations
    started_over: int = 0    # partial outputs thrown away (each a StartOver on the result)
    # Async mode: samples not returned as useful because a token was older than max_staleness
    # at return time (or the prefix to continue was): each regenerated from its prompt (its
    # tokens in tokens_regenerated) or raised as StaleSample, as the client's stale_samples says.
    stale_samples: int = 0
    stale_tokens: int = 0    # the tokens of those samples (regenerated or dropped)
    stale_dropped_tokens: int = 0  # of those, the ones of samples raised as StaleSample
    # Admission (async mode): new requests that waited because no routable engine could start
    # them inside the bound (RolloutClient's docstring), and the milliseconds they waited.
    held_at_admission: int = 0
    admission_wait_ms: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def ledger(self) -> dict[str, int]:
        """What the goodput ledger counts of this client (harness/goodput_ledger.py's RunRecord
        and Ledger names): tokens generated into no returned sample, samples not returned as
        useful for staleness, requests held at admission."""
        return {"tokens_discarded": self.tokens_regenerated + self.stale_dropped_tokens,
                "stale_samples": self.stale_samples, "held_at_admission": self.held_at_admission}


@dataclass
class Engine:
    name: str
    url: str
    model: str | None = None
    weight_version: Any = None
    incarnation: int | None = None  # which process of it the routable list named


class Split(NamedTuple):
    """One piece of a sample: output tokens [offset, offset + tokens) came from `engine`, which
    held weights `weight_version` when it made them, as the engine itself says (`span` says how
    that is known: SPAN_READ exact; SPAN_BRACKET the oldest of versions weight_version ..
    weight_version_end, e.g. an update that kept the request running; SPAN_SENT, SPAN_LISTED
    weaker). In async mode the pieces' versions never decrease: a cut request continues only on
    an engine at its last piece's newest version or newer. `outcome` is how that attempt ended
    (OK for the last piece; DIED, ABORT, ... for a piece that was continued). `seed` is the seed
    the piece was sampled with (a continued seeded request gets a derived one: see
    continuation_seed)."""

    engine: str
    weight_version: Any
    offset: int
    tokens: int
    outcome: str
    seed: int | None = None
    dropped: int = 0  # tokens received after `tokens`, thrown away (a split inside a character, no /detokenize)
    span: str = SPAN_LISTED
    weight_version_end: Any = None  # SPAN_BRACKET: the newest version its tokens may come from
    # None: the piece's KV cache was computed by its own weights (exact: what `weight_version`
    # alone makes from the prefix). Else the version whose KV cache it attended to: an
    # in-flight update in keep mode resumed the request on new weights over the old KV
    # (mixed; the piece before it ends with outcome "kept").
    kv_version: Any = None

    @property
    def newest_version(self) -> Any:
        """The newest weights its tokens may come from (a continuation goes to these or newer)."""
        return self.weight_version_end if self.span == SPAN_BRACKET else self.weight_version


def engine_label(raw: object) -> Any:
    """An engine's /weight_info `weight_version` as our versions (as the daemon's probes read
    it): "default" (base weights) is None, plain ASCII digits an int, another label a str (cut
    to 64 characters); UNREAD if it is not a str."""
    if not isinstance(raw, str):
        return UNREAD
    if raw == "default":
        return None
    if raw.isascii() and raw.isdigit() and len(raw) <= 19 and int(raw) < 2**63:
        return int(raw)
    return raw[:64]


def piece_version(listed: Any, before: Any, after: Any) -> tuple[Any, str, Any]:
    """Pure: a piece's (weight_version, span, weight_version_end) from the engine's /weight_info
    read before its attempt was sent (`before`) and after its stream ended (`after`), each a
    version (parse_version's) or UNREAD; `listed`: the daemon's listing. Versions only grow
    within an engine process, so two equal reads bracket the piece exactly; an `after` that
    is not newer than `before` (base weights, a smaller version) came from another process
    (a restart), so only `before` holds."""
    if before is UNREAD:
        return listed, SPAN_LISTED, None
    if after is UNREAD or after is None:
        return before, SPAN_SENT, None
    if after == before:
        return before, SPAN_READ, None
    lag = VersionRule.lag(before, after if isinstance(after, int) else None)
    if before is None or lag is None or lag > 0:  # newer, or a label of its own set since
        return before, SPAN_BRACKET, after
    return before, SPAN_SENT, None


class StartOver(NamedTuple):
    """Output tokens received, then thrown away: the request started over from its prompt
    (`tokens` of them, the last piece from `engine` at `weight_version`), and why."""

    engine: str
    weight_version: Any
    tokens: int
    reason: str


class Partial:
    """A logical request's output so far: the pieces kept from failed attempts (the prefix a
    continuation carries) and the partial outputs thrown away.

    Its text: `text` holds segments, each a streamed string or a window (lo, hi, head, tail)
    of output tokens whose text is built from their ids (_window_text), and covers output tokens
    [0, synced) exactly; `synced` is a point after which vLLM's detokenizer and ours agree
    (a whole character ends there). Tokens past it (a split inside a character) are kept;
    their text comes from the next piece's stream once it is known whole, the gap from ids."""

    def __init__(self) -> None:
        self.prompt_token_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = None
        self.text: list[str | tuple[int, int, str, str]] = []
        self.synced = 0
        self.head = ""  # text streamed after `synced` (the start of the gap's text, if it is one)
        self.silent: set[int] = set()  # output tokens streamed in chunks without text (held back, or skipped)
        self.piece: tuple[int, list[str], list[tuple[int, int, bool, bool]]] | None = None  # the last piece, unfolded
        self.splits: list[Split] = []
        self.started_over: list[StartOver] = []
        self.version: int | str | None = None    # the listed weight version the prefix was made on
        self.published: int | None = None        # the daemon's published version when its first piece was routed
        # Of the logical request, set once:
        self.blocker: str | None = None   # why its sampling cannot be continued (continuation_blocker)
        self.limit: int | None = None     # its max_tokens
        self.want_logprobs = False
        self.keep_stop = False            # include_stop_str_in_output: a stop token's text is in the output
        self.failed_on: dict[str, int | None] = {}  # engine -> the incarnation that failed it (a restart has not)

    def __len__(self) -> int:
        return len(self.token_ids)


class Answer:
    """One streamed completion being assembled."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: list[int] | None = None
        self.logprobs: list[float] | None = None
        self.finish_reason: str | None = None
        self.usage_tokens: int | None = None
        self.first_token: float | None = None
        self.done = False
        # After each chunk with token ids: (tokens, text pieces, whole, has text): whole when
        # that chunk held one token and text, so the text streamed so far covers every token
        # (vLLM holds back the bytes of a character split across tokens; a chunk of several
        # tokens may end holding some back).
        self.bounds: list[tuple[int, int, bool, bool]] = []
        self.silent: list[int] = []  # tokens streamed in chunks without text

    def add(self, chunk: dict[str, Any], chat: bool) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
        if chunk.get("prompt_token_ids") is not None:  # chat: on the first chunk
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or ():
            if chat:
                text = (choice.get("delta") or {}).get("content") or ""
            else:
                text = choice.get("text") or ""
            ids = choice.get("token_ids")
            if not isinstance(text, str) or not (ids is None or isinstance(ids, list)):
                raise TypeError(f"text {type(text).__name__}, token_ids {type(ids).__name__}")
            if choice.get("prompt_token_ids") is not None:  # completions: on the first chunk
                self.prompt_token_ids = list(choice["prompt_token_ids"])
            if text or ids:
                if self.first_token is None:
                    self.first_token = time.time()
                self.text.append(text)
            if ids is not None:
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(ids)
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                if chat:
                    values = [c.get("logprob") for c in lp.get("content") or ()]
                else:
                    values = list(lp.get("token_logprobs") or ())
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(values)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            if ids:
                assert self.token_ids is not None  # extended with ids above
                self.bounds.append((len(self.token_ids), len(self.text), len(ids) == 1 and bool(text), bool(text)))
                if not text:
                    self.silent.extend(range(len(self.token_ids) - len(ids), len(self.token_ids)))


def answer_tokens(answer: Answer) -> int:
    """Output tokens an attempt streamed (text chunks when the engine sent no token ids)."""
    return len(answer.token_ids) if answer.token_ids is not None else sum(1 for t in answer.text if t)
