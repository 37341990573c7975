"""`python -m vime.supervisor.reap --config FILE`: the unit's ExecStopPost=, which stops the
engines a daemon left behind when systemd will not start it again (docs/deployment.md).

The unit's KillMode=process lets engines outlive a crashed daemon, to be re-adopted by the one
systemd restarts; when a stop overruns TimeoutStopSec, though, systemd kills the daemon alone.
This stops those engines, and only ours (the journal's, checked as adoption would, and our
engine servers on a configured port), each group with SIGTERM then SIGKILL, when
$SERVICE_RESULT says systemd will not restart the daemon (success, timeout; unset: only with
--force). Never while a daemon holds the directories' lock; the exit status is always 0.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import structlog

from . import config as config_mod
from . import journal as journal_mod
from . import logs
from .config import Config, ConfigError
from .engine.adoption import LEAVE, find_engine_leaders, judge_engine, spawned_member
from .engine.process import KILL_WAIT, ProcStat, boot_id, group_members_of, kill_group_of, stop_group_of

log = structlog.get_logger("vime.reap")

# SERVICE_RESULT values after which systemd (Restart=on-failure) does not start the daemon
# again, or after which the daemon was stopping its engines anyway: see the docstring.
REAP_RESULTS = frozenset({"success", "timeout"})


def should_reap(env: Mapping[str, str], force: bool = False) -> tuple[bool, str]:
    """(reap?, why) from systemd's $SERVICE_RESULT, $EXIT_CODE and $EXIT_STATUS."""
    result = env.get("SERVICE_RESULT")
    how = f"SERVICE_RESULT={result}, EXIT_CODE={env.get('EXIT_CODE', '-')}, EXIT_STATUS={env.get('EXIT_STATUS', '-')}"
    if force:
        return True, "--force"
    if not result:
        return False, "SERVICE_RESULT is unset (not systemd's ExecStopPost); pass --force to reap anyway"
    if result in REAP_RESULTS:
        return True, f"{how}: the unit is stopping and will not be restarted (or its own stop timed out)"
    return False, f"{how}: a failure Restart=on-failure restarts; the next daemon re-adopts the engines"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m vime.supervisor.reap",
        description="ExecStopPost=: stop engines a daemon left running when systemd will not restart it "
                    "($SERVICE_RESULT success or timeout). Takes the daemon's --config and flags.")
    ap.add_argument("-c", "--config", default=os.environ.get("VIME_SUPERVISOR_CONFIG", "/etc/vime-supervisor/config.toml"))
    ap.add_argument("--force", action="store_true", help="reap whatever SERVICE_RESULT says (by hand)")
    config_mod.add_flags(ap)  # the unit passes the daemon's $VIME_SUPERVISOR_FLAGS: same state_dir
    args, _ = ap.parse_known_args(argv)  # a flag of a newer daemon must not stop the reaper
    return args


def targets_of(args: argparse.Namespace) -> tuple[Path, dict[int, str], float, list[str]]:
    """The state directory, {port: engine} of spawned engines, stop_timeout and runtime_dir, from
    the config; from the raw file when the config no longer validates (a key file's mode
    changed since the daemon started): the engines it started must still be found."""
    try:
        cfg = config_mod.load(args.config, args)
        ports = {s.port: s.name for s in cfg.engines if s.spawned and s.port is not None}
        return Path(cfg.state_dir), ports, cfg.stop_timeout, [cfg.state_dir, cfg.runtime_dir]
    except ConfigError as e:
        if isinstance(e, config_mod.ConfigReadError):
            raise
        raw = config_mod.load_file(args.config)
        log.warning("reap.config_invalid", config=args.config, problem=e.problems[0],
                    action="state_dir and engine ports read from the file as it is")
    sup = raw.get("supervisor")
    sup = sup if isinstance(sup, dict) else {}
    state_dir = args.state_dir or sup.get("state_dir") or Config.state_dir
    runtime_dir = args.runtime_dir or sup.get("runtime_dir") or Config.runtime_dir
    engines = raw.get("engines")
    engines = engines if isinstance(engines, list) else []
    ports = {e["port"]: str(e.get("name")) for e in engines
             if isinstance(e, dict) and not e.get("url") and isinstance(e.get("port"), int)}
    return Path(str(state_dir)), ports, Config.stop_timeout, [str(state_dir), str(runtime_dir)]


def daemon_holding(dirs: list[str]) -> str | None:
    """The pid in supervisor.lock of a daemon that still holds it in one of `dirs`, else None."""
    for d in dirs:
        try:
            fd = os.open(os.path.join(d, "supervisor.lock"), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        finally:
            os.close(fd)
    return None


def journal_groups(state_dir: Path) -> list[tuple[str, int, int, int | None]]:
    """(engine, pid, start_time, port) of the groups the journal names that are still ours."""
    try:
        data = journal_mod.load(state_dir / "journal.json")
    except journal_mod.JournalError as err:
        log.warning("reap.journal_unusable", error=str(err), action="engines found on configured ports only")
        return []
    if data is None:
        return []
    if data.get("boot_id") is None or data.get("boot_id") != boot_id():
        return []  # pids of another boot name nothing of ours
    if journal_mod.copied_from(data, state_dir / "journal.json") is not None:
        return []  # a copy of another daemon's journal: its pids are that daemon's
    found = []
    for name, e in data["engines"].items():
        if not e.get("pid"):
            continue
        pid, start_time, port = int(e["pid"]), int(e["start_time"]), e.get("port")
        if judge_engine(e, same_boot=True, unwanted=None).action == LEAVE:
            log.warning("reap.not_ours", engine=name, pid=pid, port=port,
                        action="left alone: not an engine server of ours on that port")
            continue
        if group_members_of(pid, start_time, spawned_member):  # the leader alive, or its group's survivors
            found.append((name, pid, start_time, port))
    return found


async def kill_now(pid: int, start_time: int, ours: Callable[[ProcStat], bool] | None = None) -> str:
    """SIGKILL a group whose graceful stop was already spent; wait at most KILL_WAIT (`ours`:
    as in process.group_members_of)."""
    if not group_members_of(pid, start_time, ours):
        return "already gone"
    kill_group_of(pid, start_time, ours)
    deadline = time.monotonic() + KILL_WAIT
    while group_members_of(pid, start_time, ours) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = group_members_of(pid, start_time, ours)
    return "SIGKILL" + (f"; {len(left)} member(s) still alive after {KILL_WAIT:g}s (D state?)" if left else "")


async def reap(state_dir: Path, ports: dict[int, str], stop_timeout: float | None, why: str) -> int:
    """Stop every group the journal names and every engine of ours on `ports`: SIGTERM, then
    SIGKILL after stop_timeout; None: SIGKILL at once. How many were stopped."""
    groups = {pid: (name, st, port, "journal") for name, pid, st, port in journal_groups(state_dir)}
    for pid, st, found_port in find_engine_leaders(set(ports)):
        groups.setdefault(pid, (ports[found_port], st, found_port, "port scan"))
    # A group only the journal names is signalled only in its members of ours; a leader the port
    # scan found is one of ours, alive, its start time read from /proc.
    hows = await asyncio.gather(*(
        kill_now(pid, st, spawned_member if source == "journal" else None) if stop_timeout is None
        else stop_group_of(pid, st, stop_timeout, spawned_member if source == "journal" else None)
        for pid, (_, st, _, source) in groups.items()))
    for (pid, (name, _st, port, source)), how in zip(groups.items(), hows):
        if how == "already gone":
            continue
        log.warning("reap.stopped", engine=name, pid=pid, port=port, found_by=source, how=how, why=why)
    return sum(how != "already gone" for how in hows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure("info")
    try:
        ok, why = should_reap(os.environ, args.force)
        if not ok:
            log.info("reap.skipped", why=why)
            return 0
        try:
            state_dir, ports, stop_timeout, dirs = targets_of(args)
        except ConfigError as e:
            log.error("reap.no_config", config=args.config, problem=e.problems[0],
                      action="nothing reaped: the config names the engines; the next start stops what is left")
            return 0
        holder = daemon_holding(dirs)
        if holder is not None:
            log.info("reap.skipped", why=f"a daemon (pid {holder}) still runs with {dirs[0]}: its engines are its own")
            return 0
        # A stop that timed out had its graceful part already (the daemon's SIGTERMs, then
        # TimeoutStopSec): SIGKILL at once. After a clean end, what is left gets SIGTERM first.
        timeout = None if os.environ.get("SERVICE_RESULT") == "timeout" else stop_timeout
        n = asyncio.run(reap(state_dir, ports, timeout, why))
        log.info("reap.done", stopped=n, why=why)
    except Exception as e:  # never mask the unit's result with ours
        log.error("reap.failed", error=repr(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
