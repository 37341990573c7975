"""What the fleet looks like from outside: the JSON of `status` and `routable`."""

from __future__ import annotations

import re
import time
from importlib import metadata

# _weights: the FSM's own wording of what an engine allowed to serve holds, so that a reason
# said again here reads as the FSM would say it now.
from .engine.fsm import _weights as allowed_weights, vlabel
from .engine.runner import EngineRunner
from .fleet import Fleet
from .router.link import RouterLink
from .protocol import EngineStatus, FleetStatus, Routable, RoutableEngine, WeightsRule
from .states import PROBED, ROUTABLE, State, VersionRule


def _version() -> str:
    try:
        return metadata.version("vime-supervisor")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


VERSION = _version()


def engine_status(fleet: Fleet, runner: EngineRunner) -> EngineStatus:
    fsm = runner.fsm
    probe = fsm.last_probe
    uptime = fsm.uptime()
    return {
        "name": runner.name,
        "state": fsm.state.value,
        "reason": reason_now(fsm.reason, fsm.state, fsm.weight_version, fleet.current_version, fleet.policy.rule),
        "routable": fleet.is_routable(runner),
        "pid": runner.pid,
        "url": runner.spec.base_url,
        "spawned": runner.spec.spawned,
        "incarnation": fsm.incarnation,
        "uptime": None if uptime is None or runner.pid is None and runner.spec.spawned else round(uptime, 1),
        "restarts": fsm.restarts,
        "failed_starts": fsm.failed_starts,
        "weight_version": fsm.weight_version,
        "version_lag": fleet.policy.lag(fsm.weight_version),
        "consecutive_failures": fsm.consecutive_failures,
        "last_probe": None if probe is None else {
            "ok": probe.ok, "detail": probe.detail,
            "latency": None if probe.latency is None else round(probe.latency, 4),
        },
        "last_probe_latency": None if probe is None or probe.latency is None else round(probe.latency, 4),
        "probes": runner.probes,
        "probe_failures": runner.probe_failures,
        "late_probes": runner.late_probes,
        "retired": runner.retired,
        "state_age": round(fleet.clock() - fsm.since, 1),
        "first_wait": runner.cfg.probe.first_wait,
        "push": None if fsm.push is None else {"id": fsm.push.push,
                                               "remaining_s": round(fsm.push.deadline - fsm.clock(), 1)},
    }


# The FSM's weights clauses (engine/fsm.py): "base weights"; "weights v3, verified" (with ", 1
# behind v4 (within max_staleness)" in async mode); "weights v3, current v5"; "weights v3" (a
# spare kept behind). Labels hold no space, comma or semicolon.
_CLAUSE = re.compile(r"\bbase weights\b|\bweights (?P<held>v[^\s,;]+|base)(?P<shape>"
                     r", verified(?:, \d+ behind v\d+ \(within max_staleness\))?|, current (?:v[^\s,;:]+|base))?")


def reason_now(reason: str, state: State, held: int | str | None, current: int | None, rule: VersionRule) -> str:
    """Pure: an engine's reason as it reads now. Its state's reason is written at its last
    transition, but later publishes, and pushes read again, move the version it holds or the
    current one without a transition (an engine serving on within max_staleness; relabelled at
    a push's end or a publish's read): in a probed state (STALE, RUNNING, SUSPECT, STANDBY) the
    reason's weights clause is said again from the present, as supervisord's description of a
    running process says its uptime now. Other states keep theirs (why it stopped, as it was).
    Before any publish, an engine whose clause says base weights while it reports a version (one
    attached with weights of its own) is said to hold that version."""
    if state not in PROBED:
        return reason
    allowed = rule.allows(held, current)

    def present(m: re.Match[str]) -> str:
        if m.group(0) == "base weights" and current is None and held is not None:
            return f"weights {vlabel(held)} (the engine's own label), none published yet"
        verified = m.group(0) == "base weights" or (m.group("shape") or "").startswith(", verified")
        if allowed and (verified or state in ROUTABLE or state is State.STANDBY):
            return allowed_weights(current, held)
        if verified and m.group("held") == vlabel(held):  # verified at it, since overtaken
            return f"weights {vlabel(held)}, verified, current {vlabel(current)}"
        if m.group("shape") is None and m.group(0) != "base weights":  # a spare kept behind
            return f"weights {vlabel(held)}"
        return f"weights {vlabel(held)}, current {vlabel(current)}"

    return _CLAUSE.sub(present, reason)


def fleet_status(fleet: Fleet, router: RouterLink | None = None) -> FleetStatus:
    engines = [engine_status(fleet, r) for r in fleet.runners.values()]
    out: FleetStatus = {
        "engines": engines,
        "round": fleet.round,
        "round_open": fleet.round_open,
        "weight_version": fleet.current_version,
        "weights": weights_rule(fleet),
        "checkpoint": fleet.checkpoint,
        "epoch": fleet.epoch,
        "routable": sum(e["routable"] for e in engines),
        "min_healthy": fleet.cfg.min_healthy,
        "spares": fleet.cfg.spares,
        "below_min_healthy": fleet.below_floor,
        "fault_tolerance": fleet.cfg.use_fault_tolerance,
        "daemon": {"pid": fleet.pid, "uptime": round(time.time() - fleet.started_at, 1), "version": VERSION,
                   "reloads": fleet.reloads},
    }
    shown = router.status() if router is not None else None
    if shown is not None:
        out["router"] = shown
    return out


def routable_view(fleet: Fleet) -> Routable:
    engines: list[RoutableEngine] = [
        {"name": r.name, "url": r.spec.base_url, "model": r.spec.model_name,
         "weight_version": r.fsm.weight_version, "incarnation": r.fsm.incarnation}
        for r in fleet.routable()
    ]
    return {"epoch": fleet.epoch, "weight_version": fleet.current_version, "weights": weights_rule(fleet),
            "engines": engines}


def weights_rule(fleet: Fleet) -> WeightsRule:
    """The mode and bound the routable set was judged by: clients (the cluster view, the
    rollout client) apply the same rule to what they hold."""
    rule = fleet.policy.rule
    return {"mode": rule.mode.value, "max_staleness": rule.bound}  # the bound in force: 0 in sync mode
