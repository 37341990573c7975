"""The control socket's verbs as a sans-IO table: each verb is written once, here, as a pure
function that builds a `Call` (method, path, body, idempotent, decode); both transports take
their verbs from `Verbs`, so SupervisorClient and AsyncSupervisorClient always have the same.

    call = Verbs.start_round.build(7)     # Call(method="POST", path="/v1/rounds/7/start", ...)
    VERBS["start_round"](7)               # the same, by name
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from dataclasses import dataclass
from typing import (
    Any,
    Awaitable,
    Callable,
    Generic,
    Literal,
    Mapping,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
)

from vime.supervisor.protocol import (
    FAILURES,
    INCIDENTS_PATH,
    METRICS_PATH,
    PUSHES_PATH,
    ROUTABLE_PATH,
    SIGNAL_FIELD,
    STATUS_PATH,
    WEIGHTS_PATH,
    Action,
    ActionResult,
    FailureResult,
    FleetStatus,
    Incident,
    IncidentList,
    PushBeginResult,
    PushEndResult,
    PushInfo,
    PushList,
    Role,
    RoundPhase,
    RoundResult,
    Routable,
    SignalResult,
    SyncBeginResult,
    SyncEndResult,
    SyncPhase,
    WeightsResult,
    daemon_log_path,
    engine_log_path,
    engine_path,
    engine_signal_path,
    engine_sync_path,
    events_path,
    push_end_path,
    round_path,
)

from .errors import ClientCode, SupervisorError

__all__ = ["Call", "Verb", "Verbs", "VERBS", "LogTail", "event_stream"]

T = TypeVar("T")
P = ParamSpec("P")
Headers = Mapping[str, str]  # lower-cased names


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its answer. `idempotent`: the daemon makes a repeat
    harmless, so a transport may resend it after a connection dropped mid-request."""

    method: str
    path: str
    body: dict[str, Any] | None
    idempotent: bool
    decode: Callable[[bytes, Headers], T]


class LogTail(str):
    """An engine's log tail (a str); `.path` is the log file on the daemon's host (one file
    per incarnation, so a new path means the engine was restarted)."""

    path: str | None

    def __new__(cls, text: str, path: str | None = None) -> "LogTail":
        obj = super().__new__(cls, text)
        obj.path = path
        return obj


# -- decoders --------------------------------------------------------------------------------


def _json(payload: bytes, headers: Headers) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        raise SupervisorError(f"the daemon answered 200 with a body that is not JSON: {payload[:200]!r}",
                              status=200, code=ClientCode.BAD_ANSWER) from None


def _text(payload: bytes, headers: Headers) -> str:
    return payload.decode("utf-8", "replace")


def _log_tail(payload: bytes, headers: Headers) -> LogTail:
    return LogTail(_text(payload, headers), headers.get("x-log-path"))


def _incidents(payload: bytes, headers: Headers) -> list[Incident]:
    listing: IncidentList = _json(payload, headers)
    return listing["incidents"]


def _push_id(payload: bytes, headers: Headers) -> str:
    answer: PushBeginResult = _json(payload, headers)
    return answer["push"]


def _pushes(payload: bytes, headers: Headers) -> list[PushInfo]:
    listing: PushList = _json(payload, headers)
    return listing["pushes"]


def _post(path: str, body: dict[str, Any] | None = None, *, idempotent: bool = True) -> Call[Any]:
    return Call("POST", path, body, idempotent, _json)


def _get(path: str, decode: Callable[[bytes, Headers], Any] = _json) -> Call[Any]:
    return Call("GET", path, None, True, decode)


# -- binding a verb to a transport ---------------------------------------------------------


class _BlockingHost(Protocol):
    _asynchronous: Literal[False]

    def _perform(self, call: Call[Any]) -> Any: ...


class _AsyncHost(Protocol):
    _asynchronous: Literal[True]

    def _perform(self, call: Call[Any]) -> Awaitable[Any]: ...


class Verb(Generic[P, T]):
    """A verb of the table: `build(...)` makes its Call; on a client instance it is a method
    that performs that Call (blocking, or a coroutine on the asyncio client)."""

    def __init__(self, build: Callable[P, Call[T]]):
        self.build = build
        self.name = build.__name__
        self.__doc__ = build.__doc__
        sig = inspect.signature(build)
        answer = sig.return_annotation  # "Call[X]": a method on a client returns X
        if isinstance(answer, str) and answer.startswith("Call[") and answer.endswith("]"):
            sig = sig.replace(return_annotation=answer[5:-1])
        self.signature = sig

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> "Verb[P, T]": ...

    @overload
    def __get__(self, obj: _AsyncHost, owner: type | None = None) -> Callable[P, Awaitable[T]]: ...

    @overload
    def __get__(self, obj: _BlockingHost, owner: type | None = None) -> Callable[P, T]: ...

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        build = self.build
        if obj._asynchronous:
            @functools.wraps(build)
            async def averb(*args: Any, **kwargs: Any) -> Any:
                return await obj._perform(build(*args, **kwargs))
            averb.__signature__ = self.signature  # type: ignore[attr-defined]
            return averb

        @functools.wraps(build)
        def verb(*args: Any, **kwargs: Any) -> Any:
            return obj._perform(build(*args, **kwargs))
        verb.__signature__ = self.signature  # type: ignore[attr-defined]
        return verb


# -- the table -------------------------------------------------------------------------------


def _weights_body(version: int, checkpoint: str | os.PathLike[str] | None,
                  fingerprint: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"version": version}
    if checkpoint is not None:
        # A relative checkpoint means the trainer's working directory, not the daemon's.
        body["checkpoint"] = os.path.abspath(os.fspath(checkpoint))
    if fingerprint is not None:  # sent only when given: a daemon without fingerprints still understands
        body["fingerprint"] = fingerprint
    return body


def _action(name: str, action: Action) -> Call[ActionResult]:
    # stop/start/retire repeat harmlessly ("already STOPPED"); restart would restart twice.
    return _post(engine_path(name, action), idempotent=action is not Action.RESTART)


class Verbs:
    """Every verb of the control socket. Both clients inherit these; each one's docstring is
    the verb's documentation."""

    @Verb
    def status() -> Call[FleetStatus]:
        """The whole fleet: engines (name, state, reason, pid, weight_version, restarts,
        routable, ...), round, round_open, weight_version, epoch, ..."""
        return _get(STATUS_PATH)

    @Verb
    def routable_engines() -> Call[Routable]:
        """{"epoch", "weight_version", "weights": {"mode", "max_staleness"}, "engines": [{"name",
        "url", "model", "weight_version"}]}: the engines that may take traffic now (the rule
        `weights` names). `epoch` changes whenever that set changes."""
        return _get(ROUTABLE_PATH)

    @Verb
    def start_round(n: int) -> Call[RoundResult]:
        """Open round n. Idempotent: starting the open round again is a no-op (changed: false),
        so a retry after a reconnect is safe. ConflictError if another round is open or n is not
        greater than the last round."""
        return _post(round_path(n, RoundPhase.START))

    @Verb
    def end_round(n: int) -> Call[RoundResult]:
        """End round n. Idempotent: ending it again is a no-op (changed: false), so a retry after
        a reconnect is safe. ConflictError if n is not the open round."""
        return _post(round_path(n, RoundPhase.END))

    @Verb
    def publish_weights(version: int, checkpoint: str | os.PathLike[str] | None = None,
                        fingerprint: dict[str, Any] | None = None) -> Call[WeightsResult]:
        """Make `version` current: engines at a version the [weights] mode no longer allows go
        STALE, out of routing, until synced (sync mode: every engine not reporting it; async
        mode: those more than max_staleness behind it, docs/weights.md#sync-and-async-modes).
        Idempotent: publishing the current version again (same checkpoint, same fingerprint or
        none) is a no-op, so a retry after a reconnect is safe. ConflictError for a version
        lower than the current one, or the current one with another checkpoint or fingerprint; BadRequest for a checkpoint that is not a directory with *.safetensors and
        config.json, or a malformed fingerprint. A relative checkpoint is made absolute against
        our working directory. `fingerprint` (vime.trainer.fingerprint.make_fingerprint): the
        logprobs the trainer's weights give for fixed prompts; an engine reporting `version`
        is routable at it only if its own match (docs/weights.md#fingerprints)."""
        return _post(WEIGHTS_PATH, _weights_body(version, checkpoint, fingerprint))

    @Verb
    def restart(name: str) -> Call[ActionResult]:
        """Stop and start a spawned engine now. Not repeated after a dropped connection."""
        return _action(name, Action.RESTART)

    @Verb
    def stop(name: str) -> Call[ActionResult]:
        """Stop a spawned engine and keep it STOPPED. Idempotent."""
        return _action(name, Action.STOP)

    @Verb
    def start(name: str) -> Call[ActionResult]:
        """Start a STOPPED/EXITED/BACKOFF/FATAL spawned engine with a fresh start budget. Idempotent."""
        return _action(name, Action.START)

    @Verb
    def retire(name: str) -> Call[ActionResult]:
        """Take an engine out of routing for good (spawned ones are stopped). Idempotent."""
        return _action(name, Action.RETIRE)

    @Verb
    def signal(name: str, sig: str | int) -> Call[SignalResult]:
        """Send a signal to a spawned engine's server process: a name ("HUP", "SIGHUP") or a
        number. What follows is the daemon's supervision (a TERM ends the engine and it is
        restarted). BadRequest (code bad_signal) for an unknown signal; ConflictError for an
        attached engine, or one with no process now (code not_running). Not repeated after a
        dropped connection (the engine would get it twice)."""
        return _post(engine_signal_path(name), {SIGNAL_FIELD: sig}, idempotent=False)

    @Verb
    def report_failure(name: str, detail: str, *, poisoned: bool = False,
                       incarnation: int | None = None) -> Call[FailureResult]:
        """A request to this engine failed: counts like a failed probe. poisoned=True: a weight
        push into it failed midway (weight_sync.PoisonedEngine), so it is stopped and restarted
        at once. incarnation: the one the request went to (status's "incarnation"); a report
        about an earlier one is ignored (counted False). Not repeated after a dropped connection
        (it would count twice)."""
        body: dict[str, Any] = {"detail": detail, "poisoned": True} if poisoned else {"detail": detail}
        if incarnation is not None:
            body["incarnation"] = int(incarnation)
        return _post(engine_path(name, FAILURES), body, idempotent=False)

    @Verb
    def sync_begin(name: str, version: int) -> Call[SyncBeginResult]:
        """The sync agent takes a STALE engine to push `version` into it ({"engine", "url",
        "version"}); the engine is SYNCING, never probed, until sync_end. ConflictError if the
        version is not current, the engine is not STALE, or (sync mode) a round is open. Not repeated after
        a dropped connection (the repeat would answer 409: check status())."""
        return _post(engine_sync_path(name, SyncPhase.BEGIN), {"version": int(version)}, idempotent=False)

    @Verb
    def sync_end(name: str, version: int, ok: bool, error: str | None = None
                 ) -> Call[SyncEndResult]:
        """The push finished: ok=True has the daemon verify the engine (/weight_info and a deep
        probe) before it is RUNNING; ok=False (with `error`) has it restarted as poisoned.
        Returns {"engine", "state", "reason"}. Not repeated after a dropped connection."""
        body = {"version": int(version), "ok": bool(ok), "error": error}
        return _post(engine_sync_path(name, SyncPhase.END), body, idempotent=False)

    @Verb
    def push_begin(version: int, engines: list[str], nbytes: int, deadline_s: float) -> Call[str]:
        """Announce a weight push of `version` (`nbytes` bytes) into `engines`, to end within
        `deadline_s`; returns its id for push_end. While it is in flight each receiver, paused,
        is excused until the deadline (not sync_timeout), and condemned if still paused past it;
        unended, it expires by itself a few seconds after its deadline. UnknownEngine for a name
        the daemon does not know; BadRequest for no engines, a name twice, bytes < 0 or a
        deadline_s not > 0; ConflictError for a version older
        than the current one, or an engine already in another push. Not repeated after a
        dropped connection (the repeat would announce a second push: check pushes())."""
        body = {"version": int(version), "engines": [str(e) for e in engines], "bytes": int(nbytes),
                "deadline_s": float(deadline_s)}
        return Call("POST", PUSHES_PATH, body, False, _push_id)

    @Verb
    def push_end(push: str, ok: bool, failed: Mapping[str, str] | None = None) -> Call[PushEndResult]:
        """End an announced push: ok, or not with `failed` ({engine: why}) naming the receivers
        that failed (reported; the daemon condemns an engine on its own evidence). Returns the
        summary: outcome, seconds, late, failed, condemned (receivers the daemon condemned during
        it). SupervisorError with code unknown_push (404) for a push ended already or expired.
        Not repeated after a dropped connection (check pushes())."""
        body: dict[str, Any] = {"ok": bool(ok)}
        if failed:
            body["failed"] = {str(k): str(v) for k, v in failed.items()}
        return _post(push_end_path(push), body, idempotent=False)

    @Verb
    def pushes() -> Call[list[PushInfo]]:
        """The announced pushes in flight: push, version, engines, bytes, deadline_s, age_s,
        remaining_s."""
        return _get(PUSHES_PATH, _pushes)

    @Verb
    def engine_log(name: str, nbytes: int = 16384) -> Call[LogTail]:
        """The last `nbytes` of the engine's current log (ConflictError for attached engines,
        which have none)."""
        return _get(engine_log_path(name, nbytes), _log_tail)

    @Verb
    def daemon_log(nbytes: int = 1600) -> Call[LogTail]:
        """The last `nbytes` of the daemon's own log, when its stderr is a file (`.path` names
        it). ConflictError (code no_log) otherwise: its message says where the log goes (the
        systemd journal's command)."""
        return _get(daemon_log_path(nbytes), _log_tail)

    @Verb
    def metrics() -> Call[str]:
        """Prometheus text exposition of the fleet."""
        return _get(METRICS_PATH, _text)

    @Verb
    def incidents() -> Call[list[Incident]]:
        """Post-mortem folders saved before unhealthy engines were stopped, oldest first."""
        return _get(INCIDENTS_PATH, _incidents)


VERBS: dict[str, Callable[..., Call[Any]]] = {
    name: v.build for name, v in vars(Verbs).items() if isinstance(v, Verb)}


def event_stream(role: Role | str = Role.OBSERVER) -> Call[None]:
    """The request that opens the event stream (GET, NDJSON answer read line by line by the
    transport's events(); re-opening it is harmless)."""
    return Call("GET", events_path(role), None, True, lambda payload, headers: None)
