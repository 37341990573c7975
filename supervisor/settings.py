"""Every setting of the daemon, declared once: each field with a knob (knobs.py) is a key of its
TOML table, with its type, default, bounds, flag, help and docs text. config.py reads a file into
these classes; the engine modules read the policies (here, at the base, so that the config need
not import them: fsm.py, warmup.py, heartbeat.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import knobs
from .knobs import Bound, ge, gt, knob
from .states import VersionRule, WeightsMode

# A late probe is judged on readings taken this far apart (engine/probes.py): each failed
# heartbeat of a hang lasts its timeout plus this.
PROGRESS_WINDOW = 0.5


@dataclass(frozen=True)
class ProbePolicy:
    """[health_check]: Kubernetes probe terms; slime's --rollout-health-check-* for the flags."""

    first_wait: float = knob(  # startup budget of each incarnation
        300.0, flag="--rollout-health-check-first-wait", metavar="S", bound=ge(0, note=" (0: no startup deadline)"),
        help="startup budget of each engine incarnation (default {default})",
        doc="startup budget of each incarnation (armed at every spawn, never per round): an engine not answering "
            "`/health` and one deep probe within it is a failed start; `0`: no deadline (warned: "
            "[errors and warnings](#errors-and-warnings))")
    interval: float = knob(  # periodSeconds
        10.0, flag="--rollout-health-check-interval", metavar="S", bound=gt(0),
        help="seconds between probes of one engine (default {default})",
        doc="seconds between heartbeats of one engine")
    timeout: float = knob(  # timeoutSeconds, per probe
        5.0, flag="--rollout-health-check-timeout", metavar="S", bound=gt(0),
        help="timeout of one probe (default {default})",
        doc="timeout of one probe (the 1-token completion); must be below `first_wait` (unless that is 0)")
    failure_threshold: int = knob(  # consecutive failures -> UNHEALTHY
        3, flag="--rollout-health-check-failure-threshold", metavar="N", bound=ge(1),
        help="consecutive failures that make an engine UNHEALTHY (default {default})",
        doc="consecutive failed heartbeats that make an engine UNHEALTHY, stopped at once")
    success_threshold: int = knob(  # consecutive successes to clear SUSPECT
        1, flag="--rollout-health-check-success-threshold", metavar="N", bound=ge(1),
        help="consecutive successes that clear SUSPECT (default {default})",
        doc="consecutive good heartbeats that clear SUSPECT")
    # A late probe is excused while the engine's processes burn CPU (a first-use compile, a
    # long prefill); busy cannot excuse it for ever: on GPU a collective that never completes
    # spins a core too. Far above a compile of a new shape (seconds here, tens of seconds on
    # GPU), well below vLLM's own VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300).
    max_busy: float = knob(
        120.0, flag="--rollout-health-check-max-busy", metavar="S", bound=gt(0, prefix="a number of seconds "),
        help="longest a late probe is excused while the engine's processes burn CPU with no token counted "
             "(default {default})",
        doc="longest a late probe is excused while the engine's processes burn CPU with no token counted (a "
            "first-use compile, a long prefill); then it is stopped as hung ([busy vs hung]"
            "(concepts.md#how-a-hang-is-seen-and-why-a-busy-engine-is-not-one))")
    # A paused engine (a weight push holds generation) is excused up to this long: the
    # config's sync_timeout, past which the push has failed anyway.
    max_paused: float = 300.0

    def hang_bound(self, *, probing_now: bool = False) -> float:
        """The longest from an engine hanging to it being UNHEALTHY: the wait for the next
        heartbeat (none with `probing_now`: a re-adopted engine is checked at once), then
        failure_threshold failed ones back to back, each its timeout and the late-probe judgement."""
        wait = 0.0 if probing_now else self.interval
        return wait + self.failure_threshold * (self.timeout + PROGRESS_WINDOW)


@dataclass(frozen=True)
class RestartPolicy:
    """[restart]"""

    start_retries: int = knob(  # supervisord's startretries
        3, flag="--start-retries", metavar="N", bound=ge(1),
        help="consecutive failed starts before FATAL (default {default})",
        doc="failed starts in a row (the first included) before FATAL; a start whose log shows a bad model path "
            "or an argument or model vLLM refuses is FATAL at once")
    backoff_initial: float = knob(  # doubles per failure
        1.0, flag="--backoff-initial", metavar="S", bound=ge(0), help="default {default}",
        doc="seconds before the second attempt; doubles with each failure, jittered")
    backoff_max: float = knob(
        60.0, flag="--backoff-max", metavar="S", bound=ge(0), help="default {default}", doc="the longest backoff")
    flapping_window: float = knob(
        600.0, flag="--flapping-window", metavar="S", bound=ge(0), help="default {default}",
        doc="the window, in seconds, over which restarts are counted")
    flapping_max_restarts: int = knob(  # systemd's StartLimitBurst
        5, flag="--flapping-max-restarts", metavar="N", bound=ge(1),
        help="restarts inside the window before FATAL (default {default})",
        doc="restarts inside the window before FATAL")


# More at once than any engine batches is no warm-up, only load (and memory in the daemon).
MAX_REQUESTS = 256


@dataclass(frozen=True)
class WarmupPolicy:
    """[warmup]: the defaults mirror a rollout batch: concurrent sampled requests with logprobs.
    Bounded: each request is held in the daemon while it runs (vLLM's own logprobs cap is 20)."""

    requests: int = knob(
        8, flag="--warmup-requests", metavar="N", bound=Bound(0, MAX_REQUESTS),
        help="concurrent warm-up requests before an incarnation is RUNNING; 0: none (default {default})",
        doc="concurrent warm-up requests sent to each new incarnation before it is RUNNING (inside `first_wait`), "
            "down the rollout's own sampling path; `0` turns the warm-up off")
    max_tokens: int = knob(16, bound=Bound(1, 4096), doc="tokens per warm-up request")
    temperature: float = knob(1.0, bound=ge(0), doc="the warm-up's sampling temperature (mirror your rollout)")
    top_p: float = knob(1.0, bound=Bound(0, 1, open_low=True), doc="the warm-up's `top_p`")
    logprobs: int = knob(1, bound=Bound(0, 20), doc="completions' `logprobs=N`; `0` asks for none")
    prompt: str = knob("The quick brown fox", doc="the warm-up's prompt")


@dataclass(frozen=True)
class EngineSpec:
    """[[engines]]: spawned engines have a model directory and a port, attached ones a url."""

    name: str = knob(doc="letters, digits, `.`, `_`, `-`; 64 at most; not starting with `.` or `-` "
                         "([errors and warnings](#errors-and-warnings))")
    model: str | None = knob(None, doc="a spawned engine's model directory (relative paths: to the config file)")
    port: int | None = knob(None, doc="a spawned engine's port")
    host: str = knob("127.0.0.1", doc="this spawned engine's address", doc_default="`[engine_defaults] host`")
    served_model_name: str | None = knob(
        None, doc="the name requests use (vLLM's `--served-model-name`); else the model path")
    args: tuple[str, ...] = knob((), doc="this engine's vLLM arguments, after `[engine_defaults] args`")
    env: dict[str, str] = knob(factory=dict, doc="this engine's environment, over `[engine_defaults] env`")
    url: str | None = knob(
        None, doc="an engine started by someone else (attached): probed and routed, never stopped or restarted by "
                  "the daemon; instead of `model` and `port`")

    @property
    def spawned(self) -> bool:
        return self.url is None

    @property
    def base_url(self) -> str:
        if self.url:
            return self.url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return f"http://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        """The name requests must use (vLLM defaults it to the model path)."""
        return self.served_model_name or self.model or ""


@dataclass(frozen=True)
class EngineDefaults:
    """[engine_defaults]: read into Config (engine_env, engine_args, api_key) and each engine's host."""

    args: tuple[str, ...] = knob(
        (), doc="vLLM arguments added to every spawned engine, before its own; `--api-key` is refused "
                "([the API key](security.md#the-api-key))")
    env: dict[str, str] = knob(
        factory=dict, doc="environment added to every spawned engine; the daemon sets `VLLM_SERVER_DEV_MODE=1` "
                          "unless given here (`/pause`, `/resume`, `/weight_info` and the weight-transfer routes "
                          "exist only in dev mode)")
    host: str = knob(
        EngineSpec.host, doc="the address every spawned engine listens on (an engine's own `host` wins); must be an "
                             "address of this machine; on a cluster, this node's cluster address; `0.0.0.0` / `::` "
                             "refused unless `allow_wildcard_bind` ([who can reach an engine](security.md))")
    allow_wildcard_bind: bool = knob(
        False, doc="`true`: accept a wildcard `host` (every interface; firewall the ports)")
    api_key_file: str | None = knob(
        None, doc="a file holding the engines' API key (one line of printable ASCII, mode 0600; relative to the "
                  "config file); spawned engines get it as `VLLM_API_KEY` in their environment, never on their "
                  "command line, and the daemon sends it as `Authorization: Bearer` to every engine")


# vime's flags for vllm-router: long RL generations trip the circuit breaker on healthy engines.
ROUTER_ARGS = ("--disable-circuit-breaker", "--request-timeout-secs", "14400")
_SECONDS = gt(0, prefix="a number of seconds ")


@dataclass(frozen=True)
class RouterConfig:
    """[router]: the router in front of the engines, fed by the daemon (docs/router.md)."""

    url: str = knob(
        flag="--router-url", metavar="URL",
        help="feed the router (vllm-router) at URL with the routable engines, e.g. http://127.0.0.1:30000",
        doc="the router's admin API (vllm-router), e.g. `http://127.0.0.1:30000`; with the table present the "
            "daemon keeps the router's worker list equal to its routable set ([Behind a router](router.md))")
    kind: str = knob("vllm-router", doc="the router's admin API: `vllm-router` (0.1.17) or `smg` (SMG 1.13.0; sglang-router 0.3.2 answers the same routes); both in the `router` extra")
    worker_type: str = knob(  # vllm-router's worker_type of every engine we add
        "regular", doc="the `worker_type` of every engine the daemon adds")
    # Report the drift, change nothing: to try the daemon beside a router that others feed.
    observe_only: bool = knob(
        False, flag="--router-observe-only",
        help="report how the router's list differs from the routable set; change nothing",
        doc="report how the router's list differs from the routable set (status, metrics, events) and change "
            "nothing")
    # Remove workers no daemon of ours owns (another node's daemon owns its own: leave off there).
    prune_unknown: bool = knob(
        False, flag="--router-prune-unknown",
        help="remove router workers that are not this daemon's engines (default: report them)",
        doc="remove workers no engine of this daemon owns; off, they are reported as drift (on many nodes each "
            "daemon owns only its own engines: leave it off there)")
    period: float = knob(  # drift repair: the router's list is read this often besides every change
        2.0, bound=Bound(0.1, 600.0, prefix="a number of seconds ",
                         why="; each reconcile reads the router's list: below 0.1 s the reads load the router, above "
                             "600 s drift stays unrepaired that long (a router someone else restarted stays empty); "
                             "1 to 10 s suits most jobs"),
        doc="seconds between reads of the router's list to repair drift, besides every membership change "
            "(0.1 to 600)")
    # Between two reconciles: one GET /workers every `watch` s; an engine of ours listed while not
    # routable (it registered itself, or a POST the router finished after ours timed out) goes.
    watch: float = knob(
        1.0, bound=Bound(0.05, 60.0, prefix="a number of seconds ",
                         why="; an engine listed while not routable stays listed up to this long: below 0.05 s the "
                             "reads load the router, above 60 s that engine gets traffic for a minute (keep the "
                             "default 1 s, below `period`)"),
        doc="seconds between reads of the router's list between two reconciles: an engine of this daemon's "
            "listed while not routable (registered by itself, or added by a `POST` the router finished after "
            "the daemon's call timed out) is removed at once; one `GET /workers` each (0.05 to 60)")
    timeout: float = knob(  # one GET or POST /workers (POST blocks until the worker answers /health)
        5.0, bound=_SECONDS, doc="one GET or POST `/workers` (a POST waits for the worker's `/health`)")
    remove_timeout: float = knob(  # one DELETE: an engine leaving the routable set is out within it
        1.0, bound=_SECONDS, doc="one DELETE: an engine leaving the routable set is out of the router within it")
    # A planned stop (operator stop/restart/retire, the daemon's shutdown): the engine leaves the
    # router, then vLLM's POST /pause?mode=wait lets its requests in flight end, at most this long.
    drain_timeout: float = knob(
        30.0, bound=_SECONDS,
        doc="a planned stop takes the engine out of the router, then waits at most this long on vLLM's "
            "`POST /pause?mode=wait` for its requests in flight; keep it below the unit's `TimeoutStopSec`")
    token_file: str = knob(
        "", doc="a file holding a bearer token sent on every admin call (for a proxy in front: vllm-router 0.1.17 "
                "has no admin authentication); owned by the daemon's user, mode 0600")
    token: str | None = field(default=None, repr=False)  # read from token_file; never printed
    # Run the router as a child of the daemon (routerchild.py): its own process group, restarted
    # with [restart]'s backoff, re-adopted across a daemon restart or reload, stopped last.
    spawn: bool = knob(
        False, doc="the daemon runs the router itself, as a child in its own process group: started before the "
                   "first reconcile, restarted when it dies (at once if it had answered, else after `[restart]`'s "
                   "`backoff_initial`, doubling up to `backoff_max`), re-filled at once, adopted across a daemon "
                   "restart or reload, stopped last ([The router as a child](router.md#the-router-as-a-child)); "
                   "`false`: it drives a router someone else runs")
    binary: str = knob(  # on PATH, else beside the daemon's interpreter (a venv's bin)
        "vllm-router", doc="with `spawn`: the router's executable, looked up on `PATH`, then beside the daemon's "
                           "interpreter (a venv's `bin`, which a unit's `PATH` lacks); or an absolute path. "
                           "`--check-config` says when it is not there")
    # Its flags besides --host/--port (from url) and --worker-urls (none: the daemon adds them).
    # Set whole: these are vime's (the breaker off, a 4-hour request timeout).
    args: tuple[str, ...] = knob(
        ROUTER_ARGS, doc="with `spawn`: the router's flags besides `--host` and `--port` (from `url`, whose host "
                         "must be an address of this machine, not `0.0.0.0`) and `--worker-urls` (none: the daemon "
                         "adds the engines); set whole, the default is vime's (breaker off, 4-hour requests). "
                         "`--host`, `--port`, `--worker-urls` and `--api-key` are refused")
    # A spawned router that answers nothing this long, starting or after it had answered (hung,
    # SIGSTOPped), is stopped and started again: a process that runs is not one that serves.
    silent_timeout: float = knob(
        60.0, bound=_SECONDS,
        doc="with `spawn`: a router that answers no `GET /workers` for this long, while starting or after it had "
            "answered (hung, stopped), is stopped and started again")


_LOG_LEVELS = ("debug", "error", "info", "warning")
SPARES_SYNC = ("promotion", "publish")
RESTART_LOAD = ("model", "dummy")
FINGERPRINT_MISMATCH = ("poison", "resync", "warn")
_NO_LIMIT = ge(0, note=" (0: no limit)")


WEIGHTS_MODES = tuple(m.value for m in WeightsMode)
# A bound past a few dozen versions is off-policy data no RL recipe trains on; 1000 is far past
# any of them and still catches a typo (a step count, a timestamp) given for a version count.
MAX_STALENESS = 1000


@dataclass(frozen=True)
class WeightsPolicy:
    """[weights]: which weight versions may serve (states.VersionRule, the one routing rule)."""

    mode: str = knob(
        "sync", flag="--weights-mode", choices=WEIGHTS_MODES,
        help="sync (default): only the current weight version serves; async: versions up to max_staleness "
             "behind it keep serving",
        doc="`sync`: an engine is routable only at the current version (a publish takes the others out of "
            "routing until synced); `async` (round-free RL): an engine verified at a version up to "
            "`max_staleness` behind the current one stays routable ([Sync and async modes]"
            "(weights.md#sync-and-async-modes))")
    max_staleness: int = knob(
        1, flag="--max-staleness", metavar="N", bound=Bound(0, MAX_STALENESS, why="; versions behind the current "
                                                                                      "one an engine may serve at"),
        help="async mode: versions behind the current one an engine may serve at, and a sample's oldest token may "
             "be from (default {default})",
        doc="async mode only: how many versions behind the current one an engine may be and still serve, and a "
            "returned sample's oldest token may be from (AReaL's maximum off-policyness); `0`: only the current "
            "version, as in sync mode")

    @property
    def rule(self) -> VersionRule:
        return VersionRule(WeightsMode(self.mode), self.max_staleness)


@dataclass(frozen=True)
class Config:
    """The daemon's config; its own fields with a knob are the [supervisor] table."""

    engines: tuple[EngineSpec, ...]
    probe: ProbePolicy = ProbePolicy()
    restart: RestartPolicy = RestartPolicy()
    use_fault_tolerance: bool = knob(
        True, flag="--use-fault-tolerance", help="probe engines and restart dead ones (default: on)",
        doc="probe engines, stop hung ones, restart dead ones; off: engines are spawned and deaths are seen, but "
            "nothing is probed or restarted")
    stop_timeout: float = knob(  # supervisord's stopwaitsecs
        10.0, flag="--stop-timeout", metavar="S", bound=gt(0), help="SIGTERM to SIGKILL (default {default})",
        doc="SIGTERM to an engine's process group, then SIGKILL after this many seconds")
    min_healthy: int = knob(
        1, flag="--min-healthy", metavar="N", bound=ge(0), help="routable engines below which the trainer is told",
        doc="fewer routable engines than this is a floor breach: logged at error level and sent to the trainer on "
            "the event stream at once, so it can fail fast instead of idling")
    restart_immediately: bool = knob(  # boot a dead engine during the round, route it after
        False, flag="--restart-immediately",
        help="boot a dead engine during the round (routed after the gap, or at once with --admit-mid-round once "
             "verified at the current version)",
        doc="`false`: a dead engine waits in EXITED until the round ends; `true`: it boots at once and joins "
            "routing in the next round gap, or at once with `admit_mid_round` once verified "
            "([Rounds](concepts.md#rounds))")
    # Full strength inside the round: a current spare takes a failed engine's place at once,
    # and an engine verified at the current version (a restart reloaded from the published
    # checkpoint, a held one) joins at once, instead of in the next gap. Version-safe: nothing
    # at another version is routable. Off: membership grows only in gaps (slime's rule).
    admit_mid_round: bool = knob(
        False, flag="--admit-mid-round",
        help="fill a failed engine's place inside the round: a current spare at once, an engine verified at the "
             "current version as soon as it is (default off: in the gap)",
        doc="`false`: membership grows only in round gaps (slime's rule); `true`: a failed engine's place is "
            "filled inside the round, by a spare at the current version at once or by an engine as soon as it is "
            "verified at the current version (a restart reloaded from the published checkpoint); never an engine "
            "at another version ([Full strength inside the round](concepts.md#full-strength-inside-the-round))")
    # Warm spares: this many engines beyond the routing target (engines - spares) are kept
    # booted and verified in STANDBY, and one takes a failed engine's place in the next gap.
    spares: int = knob(
        0, flag="--spares", metavar="K", bound=ge(0),
        help="warm spares: K engines beyond the routing target kept in STANDBY, promoted in the gap after a "
             "failure (default {default})",
        doc="warm spares: K of the engines kept beyond the routing target in STANDBY, promoted in the gap after a "
            "failure (in async mode at once) ([Warm spares](concepts.md#warm-spares)); on GPU each spare holds its "
            "GPUs all the time")
    # When a spare gets the current weights: "promotion" (synced when it takes a place: no
    # cost while nothing fails) or "publish" (synced in every gap after a publish, like a
    # serving engine: one more receiver per push, a promotion without a sync). Not given:
    # "publish" in async mode (config._spares_sync_default), where nothing waits for a gap.
    spares_sync: str = knob(
        "promotion", flag="--spares-sync", choices=SPARES_SYNC,
        doc_default='`"promotion"` (async mode: "publish")',
        help="when spares get new weights: at promotion (default in sync mode) or after every publish (default "
             "in async mode)",
        doc="when spares get new weights: when one takes a place (nothing spent while nothing fails), or after "
            "every publish that leaves them outside the versions the mode allows (one more receiver per push; a "
            "promotion with no sync: [Warm spares](concepts.md#warm-spares))")
    # How a restarted engine gets its weights: "model" (read from disk, as at its first start)
    # or "dummy" (vLLM's dummy weights when the trainer's agent is connected to push every
    # tensor: no checkpoint read; a normal restart when no push can come).
    restart_load: str = knob(
        "model", flag="--restart-load", choices=RESTART_LOAD,
        help="a restarted engine's weights: read the model (default), or dummy weights when the trainer's agent "
             "is connected to push them",
        doc="a restarted engine reads the model, or boots on vLLM's dummy weights when the trainer's agent is "
            "connected to push them ([Weights after a restart](weights.md#restarts-that-skip-the-checkpoint-read))")
    # An engine whose /weight_info says the published version but whose outputs do not match the
    # version's fingerprint: "poison" (stopped, restarted, never routed), "resync" (out of
    # routing, STALE, synced again; a sync that still does not match poisons it) or "warn"
    # (logged and counted, routed as the label says: for a tolerance not yet measured).
    fingerprint_mismatch: str = knob(
        "poison", flag="--fingerprint-mismatch", choices=FINGERPRINT_MISMATCH,
        help="an engine whose outputs do not match the published fingerprint: poison (default), resync or warn",
        doc="what an engine whose `/weight_info` says the published version but whose outputs do not match the "
            "version's fingerprint becomes: `poison` (stopped, restarted, never routed), `resync` (STALE, synced "
            "again; a sync that still does not match poisons it) or `warn` (logged and counted, routed) "
            "([Fingerprints](weights.md#fingerprints))")
    runtime_dir: str = knob(
        "/run/vime-supervisor", flag="--runtime-dir", help="holds the control socket (default {default})",
        doc="holds the control socket (`supervisor.sock`, mode 0660) and a lock; must be owned by the daemon's "
            "user (or root) and not writable by others; systemd's `RuntimeDirectory=` makes it")
    log_dir: str = knob(
        "/var/log/vime-supervisor", flag="--log-dir", help="engine logs, one file per incarnation",
        doc="engine logs, one file per incarnation (`<log_dir>/<engine>.<incarnation>.log`), and the post-mortems "
            "(`<log_dir>/incidents/`)")
    state_dir: str = knob(  # the journal (systemd's StateDirectory=)
        "/var/lib/vime-supervisor", flag="--state-dir", help="the journal that lets a restarted daemon lose nothing",
        doc="the journal (round, weight version, engine pids) that lets a restarted daemon lose nothing, and a "
            "lock")
    # Retention, so that a week of restarts cannot fill log_dir (0: no limit). Each engine keeps
    # its newest log_keep logs within log_keep_bytes, oldest incarnation removed first, the live
    # one never; the incident folders, all engines together, likewise, the newest never.
    log_keep: int = knob(
        10, flag="--log-keep", metavar="N", bound=_NO_LIMIT,
        help="each engine's newest N logs are kept, the live one always; 0: no limit (default {default})",
        doc="each engine keeps its newest N logs (one per incarnation), the oldest incarnation removed first when "
            "a new one's log is opened; the live incarnation's log is never removed (so `1` keeps only it); `0`: "
            "no limit ([Retention](operations.md#retention))")
    log_keep_bytes: int = knob(
        1 << 30, flag="--log-keep-bytes", metavar="BYTES", bound=_NO_LIMIT,
        help="each engine's logs within BYTES, oldest removed first; 0: no limit (default {default})",
        doc="each engine's logs within this many bytes (1 GiB), oldest removed first, the live one never; `0`: "
            "no limit")
    incidents_keep: int = knob(
        100, flag="--incidents-keep", metavar="N", bound=_NO_LIMIT,
        help="the newest N incident folders are kept; 0: no limit (default {default})",
        doc="the newest N post-mortem folders under `<log_dir>/incidents/` (all engines together) are kept, the "
            "oldest removed first, room made before one is written; the one being written never; `0`: no limit")
    incidents_keep_bytes: int = knob(
        256 << 20, flag="--incidents-keep-bytes", metavar="BYTES", bound=_NO_LIMIT,
        help="the incident folders within BYTES, oldest removed first; 0: no limit (default {default})",
        doc="the post-mortem folders within this many bytes in all (256 MiB), oldest removed first; `0`: no "
            "limit")
    # Each engine's compiler caches, <engine_cache_dir>/<engine>/<model digest>/; "" is
    # <state_dir>/engine-cache. Engines of the same name and model on the same host may share it.
    engine_cache_dir: str = knob(
        "", flag="--engine-cache-dir",
        help="the engines' compiler caches, kept across restarts (default <state_dir>/engine-cache)",
        doc="the engines' compiler caches (torch inductor, Triton, vLLM), `<dir>/<engine>/<model digest>/`, kept "
            "across restarts ([Warm caches](concepts.md#warm-caches-across-restarts)); `\"\"` is "
            "`<state_dir>/engine-cache`; an absolute path; under systemd, a folder outside the state directory "
            "needs `ReadWritePaths=`")
    log_level: str = knob(
        "info", flag="--log-level", choices=_LOG_LEVELS, flag_choices=False, help="debug, info, warning, error",
        doc="`debug`, `info`, `warning`, `error`")
    python: str = knob(  # interpreter for `-m vllm.entrypoints.openai.api_server`; "" = ours
        "", doc="the interpreter that runs `-m vllm.entrypoints.openai.api_server`; `\"\"` is the daemon's own")
    engine_env: dict[str, str] = field(default_factory=dict)  # for every spawned engine
    engine_args: tuple[str, ...] = ()  # for every spawned engine, before its own args
    allowed_uids: tuple[int, ...] = knob(  # control socket peers besides our own uid
        (), doc="peers of the control socket besides the daemon's own uid (checked with SO_PEERCRED)")
    socket_group: str = knob(  # group owning the socket (mode 0660), so its members can connect
        "", doc="the group that owns the socket, so its members can connect at all; `\"\"` is the daemon's own "
                "group. Under the unit, leave it `\"\"` ([the user and the socket]"
                "(deployment.md#the-user-and-the-socket))")
    sync_timeout: float = knob(  # a push or reload not verified by then poisons the engine
        300.0, bound=gt(0, note=" seconds", why="; a push or reload gets this long before the engine counts as "
                                                "poisoned"),
        doc="a push or checkpoint reload not verified within this many seconds poisons the engine; also the "
            "longest a paused engine is excused, unless it receives an announced push (excused until that push's "
            "deadline, [Announced pushes](control-socket.md#announced-pushes))")
    # Prometheus' GET /metrics over TCP: "127.0.0.1:9464"; "" for none. Loopback only, unless
    # metrics_allow_remote: the metrics name every engine and its URL.
    metrics_address: str = knob(
        "", flag="--metrics-address", metavar="HOST:PORT",
        help="serve Prometheus' GET /metrics over TCP here, e.g. 127.0.0.1:9464 (loopback only unless "
             "supervisor.metrics_allow_remote; default: none)",
        doc="`\"127.0.0.1:9464\"`: Prometheus' `GET /metrics` over TCP (`[::1]:9464` and `localhost:9464` too; an "
            "IP address, not a host name); `\"\"`: none. Loopback only: the metrics name every engine and its URL "
            "([Metrics](operations.md#metrics))")
    metrics_allow_remote: bool = knob(
        False, doc="`true`: `metrics_address` may be another address of this machine, or `0.0.0.0` (warned; "
                   "firewall the port)")
    warmup: WarmupPolicy = WarmupPolicy()  # sent to each new incarnation before it is RUNNING
    weights: WeightsPolicy = WeightsPolicy()  # [weights]: which versions may serve
    # The engines' API key (engine_defaults.api_key_file): spawned engines get it as VLLM_API_KEY
    # in their environment, never on argv; the daemon sends it to every engine. Never printed.
    api_key: str | None = field(default=None, repr=False)
    router: RouterConfig | None = None  # [router]; None: the daemon feeds no router
    # What is accepted but probably not meant: printed by --check-config, logged at start.
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.runtime_dir, "supervisor.sock")

    @property
    def engine_headers(self) -> dict[str, str]:
        """Headers for every request of the daemon's to an engine."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# Each TOML table and the class whose knob fields declare its keys, in the docs' order.
SECTIONS: dict[str, type] = {
    "supervisor": Config, "health_check": ProbePolicy, "warmup": WarmupPolicy, "restart": RestartPolicy,
    "weights": WeightsPolicy, "router": RouterConfig, "engine_defaults": EngineDefaults, "engines": EngineSpec,
}
SETTINGS = {name: knobs.settings(name, cls) for name, cls in SECTIONS.items()}
