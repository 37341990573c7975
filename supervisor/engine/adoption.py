"""Is this pid ours? The one answer, for every child the daemon supervises (engines and the
spawned router), and what a previous daemon image left of one engine.

A process a journal names is adopted only if it is still that very process (same boot, same
/proc start time), leads its own group, serves the journal's port, and this config would start
it the same way (`verdict`, pure); one no journal names only if a daemon of ours spawned it
(`spawned_leader`). The /proc facts are read here (`judge_engine`, `judge_router`, `take_over`)
and nowhere else for this question (tests/unit/test_layout.py). `Adoption` is what the runner
reads while an adopted engine is checked again. Docs: docs/operations.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..states import State
from .process import ENGINE_MODULE, SPAWN_MARK, ChildProcess, ProcStat, all_procs, cmdline, listening_pids, \
    proc_stat, reap_child

S = State

# What to do with a process a journal names.
ADOPT = "adopt"  # ours, wanted: taken over
STOP = "stop"  # ours, that very process, but this config would not start it: its group is stopped
GONE = "gone"  # not running, or its pid is another process's now: nothing of it to take over
LEAVE = "leave"  # never signalled: another boot's journal, or a live process that is not ours now

# The journal states worth keeping an engine in (an engine hung, mid-sync or being stopped is not).
KEPT_STATES = (S.RUNNING.value, S.SUSPECT.value, S.STALE.value, S.STARTING.value, S.STANDBY.value)


class Verdict(NamedTuple):
    action: str  # ADOPT, STOP, GONE or LEAVE
    why: str  # "" for ADOPT


def verdict(start_time: int, *, same_boot: bool, leader: ProcStat | None, alien: str | None,
            unwanted: str | None) -> Verdict:
    """The process a journal entry names (its pid's /proc/PID/stat now: `leader`; the entry's
    `start_time`). `alien`: why that process is not one of ours serving the journal's port
    (None: it is); `unwanted`: why this config would not start it (None: it would)."""
    if not same_boot:
        return Verdict(LEAVE, "the journal is of another boot: its pid names nothing now")
    if leader is None or leader.state == "Z":
        return Verdict(GONE, "it is no longer running")
    if leader.start_time != start_time:
        return Verdict(GONE, "its pid is another process's now (another start time)")
    if leader.pgrp != leader.pid:
        return Verdict(LEAVE, "that process no longer leads its own process group: left alone")
    if alien is not None:  # a hand-edited journal must never get another program signalled
        return Verdict(LEAVE, alien)
    if unwanted is not None:
        return Verdict(STOP, unwanted)
    return Verdict(ADOPT, "")


def engine_unwanted(entry: dict[str, Any], *, configured: bool, spawned: bool, retired: bool,
                    fingerprint: str | None) -> str | None:
    """Why this config would not keep the engine a journal entry names (None: it would).
    `fingerprint`: what this config starts for it (process.engine_fingerprint)."""
    if not configured:
        return "no longer in the config"
    if not spawned:
        return "now attached by url, no longer spawned"
    if retired:
        return "retired"
    if entry.get("fingerprint") != fingerprint:
        return ("started under another config (its model, port, args or env differ from this one's)"
                if entry.get("fingerprint") else "no config fingerprint in the journal (an older daemon's)")
    if entry.get("state") not in KEPT_STATES:
        return f"it was {entry.get('state')}, not a state worth keeping"
    return None


def router_unwanted(entry: dict[str, Any], fingerprint: str | None) -> str | None:
    """Why this config would not keep the spawned router a journal names (`fingerprint`: what
    this config starts, child.router_fingerprint; None: it spawns no router)."""
    if fingerprint is None:
        return "the config no longer spawns a router"
    if entry.get("fingerprint") != fingerprint:
        return "started under another config (its url, binary or args differ from this one's)"
    return None


def claimed_elsewhere(name: str, entry: dict[str, Any], *, owners: dict[int, str], claimed: set[int]) -> str | None:
    """Why the process a journal entry names belongs to another engine (None: it does not):
    another entry took it over (`claimed`: adopted pids), or it serves a port this config gives
    another engine.
    Only a hand-edited journal says so; that process is judged by its own engine's entry, and
    this one leaves it alone (never adopted, never signalled)."""
    if int(entry["pid"]) in claimed:
        return "its pid is another journal entry's process"
    owner = owners.get(entry.get("port"))  # type: ignore[arg-type]
    if owner is not None and owner != name:
        return f"it serves port {entry.get('port')}, engine {owner}'s in this config"
    return None


def port_disowned(entry: dict[str, Any], *, port: int | None, fingerprint: str | None) -> str | None:
    """Why an entry of a configured spawned engine names a process that is not its (None: it may
    be): its config fingerprint is this config's (`fingerprint`), which includes the port, yet
    it names another port than this config's (`port`). Only a hand edit or a copied journal
    says so: that process is left alone (never adopted, never signalled)."""
    if fingerprint is not None and entry.get("fingerprint") == fingerprint and entry.get("port") != port:
        return (f"the journal gives it port {entry.get('port')}, but its config (fingerprint) is this one's, "
                f"which serves it on port {port}: a hand-edited or copied journal")
    return None


# -- the facts, from /proc ----------------------------------------------------------------------


def judge_engine(entry: dict[str, Any], *, same_boot: bool, unwanted: str | None) -> Verdict:
    """`verdict` for the engine a journal entry (with a pid) names: ours if it is an engine
    server of ours (engine_leader_port) on the journal's port."""
    leader = proc_stat(int(entry["pid"])) if same_boot else None
    alien = None
    if leader is not None and leader.state != "Z" and engine_leader_port(leader) != entry.get("port"):
        alien = "not an engine server of ours on that port"
    return verdict(int(entry["start_time"]), same_boot=same_boot, leader=leader, alien=alien, unwanted=unwanted)


def judge_router(entry: dict[str, Any], *, same_boot: bool, unwanted: str | None) -> Verdict:
    """`verdict` for the spawned router a journal names: ours if its group listens on the
    journal's port (vllm-router rewrites its environment: it carries no SPAWN_MARK)."""
    pid = int(entry["pid"])
    alien = None if group_listens(pid, entry.get("port")) else (
        f"its process group does not listen on the journal's port {entry.get('port')}: not a router of ours, "
        "left alone")
    return verdict(int(entry["start_time"]), same_boot=same_boot, leader=proc_stat(pid) if same_boot else None,
                   alien=alien, unwanted=unwanted)


def take_over(pid: int, start_time: int, log_path: Path) -> ChildProcess | None:
    """Take over a process a previous daemon spawned, if `pid` is still that very process
    (same start time) and still leads its own group; None if not (or it died as it was taken).

    The pidfd first, then the checks: the pidfd pins the process, so the checks cannot pass for
    one process and the pidfd name another that reused the number in between."""
    if reap_child(pid) is not None:  # died during the exec of a reload: our zombie, now reaped
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    st = proc_stat(pid)
    if st is None or st.state == "Z" or st.start_time != start_time or st.pgrp != st.pid:
        os.close(fd)
        return None
    return ChildProcess.watch(pid, fd, log_path)


def _marked(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{SPAWN_MARK}=1".encode() in f.read().split(b"\0")
    except OSError:
        return False


def spawned_member(st: ProcStat) -> bool:
    """`st` was spawned by a daemon of ours: an engine or a child of one (EngineCore inherits
    SPAWN_MARK). What may be signalled in a group a journal names whose leader cannot vouch
    for it (process.group_members_of's `ours`): never a stranger in a reused group id. The
    router rewrites its environment; its leftovers are found by its port (router/child.py)."""
    try:
        if os.stat(f"/proc/{st.pid}").st_uid != os.getuid():
            return False
    except OSError:
        return False
    return st.pid != os.getpid() and _marked(st.pid)


def spawned_leader(st: ProcStat) -> bool:
    """`st` could be a process ChildProcess.spawn made: alive, not us, our uid, leader of its
    own process group, and leading its own session (the router; engines of older daemons) or
    marked (SPAWN_MARK)."""
    if st.pgrp != st.pid or st.state == "Z" or st.pid == os.getpid() or st.pgrp == os.getpgrp():
        return False
    try:
        if os.stat(f"/proc/{st.pid}").st_uid != os.getuid():
            return False
        return os.getsid(st.pid) == st.pid or _marked(st.pid)  # a system call before a file read
    except OSError:
        return False


def engine_leader_port(st: ProcStat) -> int | None:
    """The port of `st` if it looks like an engine a daemon of ours spawned (spawned_leader),
    with `-m vllm.entrypoints.openai.api_server` and `--port P` on its command line; else None."""
    if not spawned_leader(st):
        return None
    argv = cmdline(st.pid)
    if not any(a == "-m" and b == ENGINE_MODULE for a, b in zip(argv, argv[1:])):
        return None
    port = next((b for a, b in zip(argv, argv[1:]) if a == "--port"), None)
    return int(port) if port is not None and port.isdigit() else None


def looks_like_our_router(st: ProcStat) -> bool:
    """A router a daemon of ours spawned (spawned_leader), named a router (vllm-router renames
    itself vllm::router)."""
    return spawned_leader(st) and "router" in st.comm


def router_of_ours_on(port: int) -> ProcStat | None:
    """The leader of a router group of ours (looks_like_our_router) that holds `port` and that
    no other live daemon supervises: one no journal names (a daemon killed as it spawned it)."""
    for pid in listening_pids(port):
        try:
            st = proc_stat(os.getpgid(pid))
        except OSError:
            continue
        if st is not None and looks_like_our_router(st) and not supervised_elsewhere(st):
            return st
    return None


def group_listens(pgid: int, port: Any) -> bool:
    """A process of group `pgid` holds a listening socket on `port` (the router's)."""
    if not isinstance(port, int):
        return False
    for pid in listening_pids(port):
        try:
            if os.getpgid(pid) == pgid:
                return True
        except OSError:
            continue
    return False


def supervised_elsewhere(st: ProcStat) -> bool:
    """Its parent is a live supervisor daemon other than us: that daemon's engine (an orphan's
    parent is init or a subreaper)."""
    if st.ppid in (0, 1, os.getpid()):
        return False
    argv = cmdline(st.ppid)
    return (any(a == "-m" and b in ("supervisor", "vime.supervisor") for a, b in zip(argv, argv[1:]))
            or any(os.path.basename(a) == "vime-supervisor" for a in argv[:2]))


def find_engine_leaders(ports: set[int]) -> list[tuple[int, int, int]]:
    """(pid, start_time, port) of engine leaders of ours (engine_leader_port) on one of
    `ports` that no other live daemon supervises. For when no journal can say which pids
    they are."""
    found = []
    for st in all_procs():
        port = engine_leader_port(st)
        if port in ports and not supervised_elsewhere(st):
            found.append((st.pid, st.start_time, port))
    return found


# -- what a previous daemon image left of one engine -------------------------------------------


@dataclass
class Adoption:
    proc: ChildProcess | None = None  # from the journal, taken by the first start
    routable: bool = False  # it was serving when the previous daemon died
    unwarmed: bool = False  # it was still STARTING: its warm-up may not have run
    standby: bool = False  # it was a spare: it stays one
    up: bool = False  # it had been up (not STARTING): the socket waits for its check (a reload, a restart)
    state: State | None = None  # the state the journal gave it when adopted
    age: float = 0.0  # seconds since its spawn, when it was adopted STARTING (first_wait goes on)
    after: str = ""  # "a daemon restart" or "a reload", for the transition's reason

    @classmethod
    def of(cls, proc: ChildProcess, state: str, *, after: str, age: float, spares: bool) -> Adoption:
        """`state`: one of the kept states' values (the journal's, checked by the caller);
        `age`: seconds since its spawn; `spares`: the fleet keeps spares."""
        unwarmed = state == S.STARTING.value
        return cls(proc=proc, routable=state in (S.RUNNING.value, S.SUSPECT.value), unwarmed=unwarmed,
                   standby=state == S.STANDBY.value and spares, up=not unwarmed, state=S(state),
                   age=age if unwarmed else 0.0, after=after)

    def take(self) -> ChildProcess | None:
        """The adopted process, handed over once (to the start, or to a stop before it)."""
        proc, self.proc = self.proc, None
        return proc
