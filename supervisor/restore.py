"""Pick up where a previous daemon left off: the round, the weight version, the membership
epoch, and every child process it left running (engines and the spawned router), each adopted
or stopped.

Nothing is left unsupervised: a process of ours is adopted (engine/adoption.py's one verdict) or
stopped, whether the journal names it or cannot (unreadable, or of another boot: then our
engines are found by their command line and configured port). Docs: docs/operations.md.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import structlog

from . import journal as journal_mod
from .config import Config
from .engine.adoption import ADOPT, LEAVE, STOP, claimed_elsewhere, engine_unwanted, find_engine_leaders, judge_engine, \
    port_disowned, spawned_member, take_over
from .engine.process import boot_id, engine_fingerprint, group_members_of, kill_group_of, reap_child, stop_group_of
from .engine.runner import EngineRunner
from .fleet import Fleet
from .journal import JournalError
from .protocol import Event
from .router.child import stop_leftover
from .router.link import RouterLink
from .states import State

log = structlog.get_logger("vime.supervisor")

__all__ = ["restore"]


async def restore(fleet: Fleet, cfg: Config, path: Path, *, generation: int, router: RouterLink | None) -> None:
    """Before any runner starts: `fleet`'s runners exist, none runs. `generation`: reloads this
    process has been through (0: a fresh start, or a daemon restart)."""
    data = read_journal(path)
    # Past the previous daemon's epoch and the wall clock, even with no usable journal.
    fleet.policy.resume_epoch(None if data is None else data.get("epoch"), wall_ms=int(time.time() * 1000))
    adopted: list[str] = []
    gone: list[str] = []
    killed: list[tuple[int, int, set[int]]] = []
    if data is not None:
        fleet.restore(round_number=data.get("round"), round_open=bool(data.get("round_open")),
                      version=data.get("weight_version"), checkpoint=data.get("checkpoint"),
                      fingerprint=journal_mod.fingerprint_of(data))
        here, then = boot_id(), data.get("boot_id")
        # Pids and start times name processes of one boot only; without both ids (an
        # older journal) we cannot tell, so nothing is adopted or killed by pid.
        same_boot = here is not None and then == here
        if not same_boot and any(e.get("pid") for e in data["engines"].values()):
            log.warning("journal.other_boot", journal_boot=then, this_boot=here,
                        action="no engine adopted or killed by pid; ours are found by command line and port")
        elsewhere = journal_mod.copied_from(data, path)
        if elsewhere is not None and any(e.get("pid") for e in data["engines"].values()):
            log.warning("journal.copied", journal_path=str(path), written_at=elsewhere,
                        action="no engine adopted or killed by pid: they are the daemon's that wrote it; "
                               "ours are found by command line and port")
        # A copy (another daemon's state_dir) names that daemon's processes: like another boot's.
        same_boot = same_boot and elsewhere is None
        after = "a reload" if generation else "a daemon restart"
        if data.get("router") is not None:  # [router] spawn: adopted, or stopped if not wanted
            child = router.child if router is not None else None
            if child is not None:
                await child.restore(data["router"], same_boot=same_boot, after=after)
            else:
                await stop_leftover(data["router"], same_boot=same_boot, timeout=cfg.stop_timeout)
        owners = {s.port: s.name for s in cfg.engines if s.spawned and s.port is not None}
        claimed: set[int] = set()  # pids an entry took over (adopted): no other entry touches them
        # The entry whose own configured port is the one it names goes first: a bad entry naming
        # the same pid (a hand edit, a copy) is then refused, never the rightful one.
        for name, entry in sorted(data["engines"].items(), key=lambda kv: owners.get(kv[1].get("port")) != kv[0]):
            runner = fleet.runners.get(name)
            if runner is not None:
                restore_runner(runner, entry, generation)
            if not entry.get("pid") or not same_boot:
                continue
            elsewhere = claimed_elsewhere(name, entry, owners=owners, claimed=claimed)
            if elsewhere is None and runner is not None and runner.spec.spawned:
                elsewhere = port_disowned(entry, port=runner.spec.port,
                                          fingerprint=engine_fingerprint(runner.spec, runner.cfg))
            if elsewhere is not None:
                log.warning("journal.not_ours", engine=name, pid=entry["pid"], port=entry.get("port"), why=elsewhere,
                            action="left alone: the journal names another engine's process here")
                continue
            outcome = take_engine(fleet, name, runner, entry, after)
            if outcome == "adopted":
                claimed.add(int(entry["pid"]))
                adopted.append(name)
                continue
            if outcome == "left":
                continue
            if outcome == "gone":
                gone.append(name)
            pid, start_time = int(entry["pid"]), int(entry["start_time"])
            doomed = {st.pid for st in group_members_of(pid, start_time, spawned_member)}
            kill_group_of(pid, start_time, spawned_member)  # its leftovers of ours, if any
            killed.append((pid, start_time, doomed))
    await await_gone(killed)
    await stop_orphans(fleet, cfg, {r.adoption.proc.pid for r in fleet.runners.values() if r.adoption.proc is not None})
    log.info("journal.restored", round=fleet.round, round_open=fleet.round_open, epoch=fleet.epoch,
             weight_version=fleet.current_version, fingerprint=fleet.fingerprint is not None, adopted=adopted,
             gone=gone)


def read_journal(path: Path) -> dict[str, Any] | None:
    """The journal, or None for a clean start: none, or one that cannot be trusted (moved aside)."""
    try:
        data = journal_mod.load(path)
    except JournalError as e:
        bad = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        try:
            os.replace(path, bad)
            moved = str(bad)
        except OSError as err:  # kept where it is; the first write replaces it
            moved = f"not moved ({err})"
        log.error("journal.unusable", error=str(e), moved_to=moved, action="clean start",
                  engines="ours still running on configured ports are found and stopped")
        return None
    if data is None:
        log.info("journal.none", path=str(path), action="clean start")
    return data


def restore_runner(runner: EngineRunner, entry: dict[str, Any], generation: int) -> None:
    """What the journal says of a configured engine, whatever its process."""
    # A reload changes nothing an operator must decide: FATAL stays FATAL unless its config
    # changed (a restart of the daemon gives it a fresh start).
    fatal = (entry.get("state") == State.FATAL.value and generation > 0 and runner.spec.spawned
             and entry.get("fingerprint") == engine_fingerprint(runner.spec, runner.cfg))
    runner.restore(incarnation=int(entry.get("incarnation", 0)),
                   restarts=int(entry.get("restarts", 0)), retired=bool(entry.get("retired")),
                   operator_stopped=(entry.get("state") == State.STOPPED.value
                                     and bool(entry.get("operator_stopped"))),
                   routable=entry.get("state") in (State.RUNNING.value, State.SUSPECT.value),
                   fatal=_carried(entry.get("reason") or "FATAL") if fatal else None)


def take_engine(fleet: Fleet, name: str, runner: EngineRunner | None, entry: dict[str, Any], after: str) -> str:
    """The process a journal entry of this boot names: "adopted" (its runner takes it over),
    "left" (not ours: never signalled), "gone" (a configured spawned engine not taken over: its
    group's leftovers are killed) or "stopped" (ours, not wanted: its group is killed)."""
    spawned = runner is not None and runner.spec.spawned
    unwanted = engine_unwanted(entry, configured=runner is not None, spawned=spawned,
                               retired=runner is not None and runner.retired,
                               fingerprint=engine_fingerprint(runner.spec, runner.cfg) if spawned and runner else None)
    verdict, why = judge_engine(entry, same_boot=True, unwanted=unwanted)
    pid, start_time = int(entry["pid"]), int(entry["start_time"])
    if verdict == LEAVE:
        # A live process that is not an engine of ours on the journal's port (a hand-edited
        # or foreign journal): never adopted, never signalled.
        log.warning("journal.not_ours", engine=name, pid=pid, port=entry.get("port"),
                    action="left alone: not an engine server of ours on that port")
        return "left"
    if runner is None or not runner.spec.spawned:  # what this config would not have started: say so
        if group_members_of(pid, start_time, spawned_member):
            log.warning("journal.not_adopted", engine=name, pid=pid, why=unwanted, action="killed its process group")
            fleet.emit(Event.NOT_ADOPTED, engine=name, pid=pid, why=unwanted)
        return "stopped"
    if verdict == ADOPT and isinstance(entry.get("log_path"), str):
        proc = take_over(pid, start_time, Path(entry["log_path"]))
        if proc is not None:
            runner.adopt(proc, entry, after)
            return "adopted"
    elif verdict == STOP:
        log.warning("journal.not_adopted", engine=name, pid=pid, state=entry.get("state"), why=why,
                    port=entry.get("port"), action="killed its process group; a fresh one is started")
        fleet.emit(Event.NOT_ADOPTED, engine=name, pid=pid, why=why)
    return "gone"


async def await_gone(groups: list[tuple[int, int, set[int]]]) -> None:
    """Groups just sent SIGKILL: wait (bounded) until they are gone, so the orphan scan does
    not see them again and a new spawn finds the port free. A leader that is our child (after
    a reload) is reaped, not left a zombie."""
    deadline = time.monotonic() + 5.0
    # Waited on by pid, unfiltered: a process being killed can no longer show its spawn mark.
    while (any(st.pid in doomed for p, t, doomed in groups for st in group_members_of(p, t))
           and time.monotonic() < deadline):
        await asyncio.sleep(0.05)
    for pid, _, _ in groups:
        reap_child(pid)


async def stop_orphans(fleet: Fleet, cfg: Config, keep: set[int]) -> None:
    """Engines of ours that no journal accounts for (a corrupt or lost journal, another boot's):
    group leaders a daemon of ours spawned, running our engine module on a port this config
    spawns on. They would hold the port and outlive us: stop them."""
    ports = {s.port: s.name for s in cfg.engines if s.spawned and s.port is not None}
    found = [(pid, st, port) for pid, st, port in find_engine_leaders(set(ports)) if pid not in keep]
    hows = await asyncio.gather(*(stop_group_of(pid, st, cfg.stop_timeout) for pid, st, _ in found))
    for (pid, _st, port), how in zip(found, hows):
        log.warning("journal.orphan_stopped", pid=pid, port=port, engine=ports[port], how=how,
                    why="an engine process of ours on a configured port that the journal does not name")
        fleet.emit(Event.ORPHAN_STOPPED, pid=pid, port=port, engine=ports[port], how=how)


def _carried(reason: str, note: str = " (FATAL before a reload)") -> str:
    return reason if reason.endswith(note) else reason + note
