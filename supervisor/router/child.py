"""The router as a child of the daemon ([router] spawn = true), run like an engine
(docs/router.md).

It leads a session of its own (vllm-router rewrites its environment, so leading its session is
what marks it ours), starts before the feed's first reconcile, is restarted when it dies (at
once if it had answered, else with [restart]'s backoff), refills the feed the moment it answers
again, is journaled and adopted by engine/adoption.py's one verdict, and stops last. The
decisions (the command, the backoff) are pure functions; `RouterChild` does the process I/O
through process.ChildProcess, as an engine's incarnation does. The engines' API key is not
given to it (vllm-router forwards each client's own Authorization header).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator
from urllib.parse import urlsplit

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..config import Config, RestartPolicy, RouterConfig, find_binary
from ..engine.fsm import backoff_delay
from ..engine.adoption import ADOPT, STOP, judge_router, router_of_ours_on, router_unwanted, take_over
from ..engine.process import NOT_INHERITED, ChildProcess, describe_returncode, port_is_free, read_tail, stop_group_of
from ..protocol import Event
from ..tasks import TaskSet, cancel_and_wait, wait_event

log = structlog.get_logger("vime.router")

STARTUP_BOUND = 60.0  # a router that has not answered GET /workers by then is stopped: a failed start
ANSWER_POLL = 0.1  # how often a starting router is asked
SERVING_POLL = 2.0  # how often a running one is (router.silent_timeout bounds its silence)
LOG_ROTATE_BYTES = 64 << 20  # router.log is moved to router.log.1 past this, at a spawn


# -- pure decisions ---------------------------------------------------------------------------


def router_command(rcfg: RouterConfig, binary: str) -> list[str]:
    """The router's command line: the configured args, then --host and --port from url and no
    workers (the daemon adds the routable engines). Ours come last: argparse keeps the last
    value, so an arg that names one of them anyway (a prefix such as --hos) cannot win."""
    u = urlsplit(rcfg.url)
    sub = ["launch"] if rcfg.kind == "smg" else []  # `smg launch`: the router alone
    return [binary, *sub, *rcfg.args, "--host", u.hostname or "127.0.0.1", "--port", str(u.port), "--worker-urls"]


def router_fingerprint(rcfg: RouterConfig) -> str:
    """What this config starts (the binary as configured, host, port, args): in the journal, so
    a daemon adopts only a router it would have started itself."""
    blob = json.dumps(router_command(rcfg, rcfg.binary))
    return hashlib.sha256(blob.encode()).hexdigest()


class Restarts:
    """When to start the router again after it ended."""

    def __init__(self, policy: RestartPolicy, rng: random.Random | None = None):
        self.policy = policy
        self.rng = rng or random.Random()
        self.failures = 0  # starts in a row that ended before the router answered
        self.count = 0  # restarts so far (vime_router_restarts_total)

    def ended(self, answered: bool) -> float:
        """Seconds before the next start. One that had answered is a new fault: at once. One
        that never answered (a bad flag, a port taken) waits [restart]'s backoff, doubling per
        failed start in a row up to backoff_max, jittered as the engines' is; never given up on:
        the daemon cannot feed a router that does not run."""
        self.count += 1
        if answered:
            self.failures = 0
            return 0.0
        self.failures += 1
        return backoff_delay(self.failures, self.policy, self.rng)


# -- the process ------------------------------------------------------------------------------


class RouterChild:
    """The spawned router: one process at a time, watched by one task."""

    def __init__(self, cfg: Config, emit: Callable[..., None], persist: Callable[[], None], *,
                 clock: Callable[[], float] = time.monotonic):
        assert cfg.router is not None
        self.cfg, self.rcfg = cfg, cfg.router
        self.emit, self.persist, self.clock = emit, persist, clock
        self.fingerprint = router_fingerprint(self.rcfg)
        self.restarts = Restarts(cfg.restart)
        self.log_path = Path(cfg.log_dir) / "router.log"
        self.proc: ChildProcess | None = None
        self.state = "starting"  # starting, running, backoff, stopping, stopped
        self.adopted = False  # the running process is a previous daemon image's
        self.error: str | None = None  # why the last start failed, until one answers
        # Asked while it starts: True once the router answers its admin API (set by the daemon).
        self.answers: Callable[[], Awaitable[bool]] = _never
        self.on_up: Callable[[], None] = lambda: None  # the feed's refill
        self.up = asyncio.Event()  # set while the running router has answered
        self._task: asyncio.Task[None] | None = None

    # -- the journal -----------------------------------------------------------------------

    def journal_entry(self) -> dict[str, Any] | None:
        p = self.proc
        if p is None or p.returncode is not None or p.start_time is None:
            return None
        return {"pid": p.pid, "start_time": p.start_time, "fingerprint": self.fingerprint,
                "port": urlsplit(self.rcfg.url).port, "log_path": str(p.log_path)}

    async def restore(self, entry: dict[str, Any], *, same_boot: bool, after: str) -> None:
        """Adopt the router a previous daemon image left (before start())."""
        pid, start_time = int(entry["pid"]), int(entry["start_time"])
        verdict, why = judge_router(entry, same_boot=same_boot, unwanted=router_unwanted(entry, self.fingerprint))
        if verdict == ADOPT:
            proc = take_over(pid, start_time, Path(entry.get("log_path") or self.log_path))
            if proc is not None:
                self.proc, self.adopted = proc, True
                log.info("router.adopted", pid=pid, after=after, url=self.rcfg.url)
                self.emit(Event.ROUTER_PROCESS, action="adopted", pid=pid, after=after)
                return
            why = "it ended as it was being adopted"
        if verdict == STOP:
            how = await stop_group_of(pid, start_time, self.cfg.stop_timeout)
            log.warning("router.not_adopted", pid=pid, why=why, action=f"stopped its process group ({how}); "
                        "a fresh one is started")
            self.emit(Event.ROUTER_PROCESS, action="not_adopted", pid=pid, why=why, how=how)
        else:
            log.info("router.not_adopted", pid=pid, why=why, action="a fresh one is started")

    # -- supervision -----------------------------------------------------------------------

    def start(self, tasks: TaskSet) -> None:
        self._task = tasks.spawn(self._run(), name="router-process")

    async def answered(self, bound: float) -> bool:
        """Until the router has answered (at most `bound` s): the feed's first reconcile waits."""
        return await wait_event(self.up, bound)

    async def _run(self) -> None:
        delay = 0.0
        while True:
            if self.proc is None:
                if delay:
                    self._set("backoff")
                    await asyncio.sleep(delay)
                self._set("starting")
                self.proc = await self._spawn()
                if self.proc is None:  # not even started: counted as a failed start
                    delay = self.restarts.ended(False)
                    continue
            proc = self.proc
            answered = await self._until_answered(proc)
            if answered:
                self.error = None
                self._set("running")
                self.up.set()
                log.info("router.up", pid=proc.pid, url=self.rcfg.url, adopted=self.adopted,
                         action="the feed re-fills it with the routable engines now")
                self.on_up()
                if not await self._serving(proc):
                    self.error = (f"answered no GET {self.rcfg.url}/workers for {self.rcfg.silent_timeout:g}s "
                                  "(router.silent_timeout): stopped, started again")
                    log.warning("router.silent", pid=proc.pid, silent_timeout=self.rcfg.silent_timeout,
                                action="stopped and started again")
                    await proc.stop(self.cfg.stop_timeout)
            elif proc.returncode is None:  # never answered within its bound
                self.error = f"did not answer {self.rcfg.url}/workers within {self._startup_bound():g}s"
                await proc.stop(self.cfg.stop_timeout)
            self.up.clear()
            how = describe_returncode(proc.returncode, adopted=proc.status_unknown)
            if not answered and self.error is None:
                last = [ln for ln in read_tail(proc.log_path, 4096).splitlines() if ln.strip()]
                self.error = f"{how} before it answered" + (f": {last[-1][:200]}" if last else "")
            delay = self.restarts.ended(answered)
            self.proc, self.adopted = None, False
            self.persist()
            log.warning("router.exited", pid=proc.pid, how=how, answered=answered, restart_in=round(delay, 3),
                        restarts=self.restarts.count, error=self.error, log=str(proc.log_path))
            self.emit(Event.ROUTER_PROCESS, action="exited", pid=proc.pid, how=how, restart_in=round(delay, 3),
                      error=self.error)

    async def _spawn(self) -> ChildProcess | None:
        binary = find_binary(self.rcfg.binary)
        u = urlsplit(self.rcfg.url)
        if binary is None:
            self.error = f"{self.rcfg.binary} is not on PATH nor beside the daemon's interpreter"
        elif (not port_is_free(u.hostname or "127.0.0.1", u.port or 0)
              and not (await self._stop_orphan(u.port or 0) and port_is_free(u.hostname or "127.0.0.1", u.port or 0))):
            self.error = (f"port {u.port} on {u.hostname} is taken by a program that is not a router of ours; "
                          "stop it, or change router.url")
        else:
            _rotate(self.log_path)
            env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
            cmd = router_command(self.rcfg, binary)
            try:
                proc = await ChildProcess.spawn(cmd, env, self.log_path, own_session=True)
            except OSError as e:
                self.error = f"cannot run {binary}: {e.strerror or e}"
            else:
                self.proc = proc
                self.persist()  # journaled before anything else: a daemon killed now adopts it
                log.info("router.spawned", pid=proc.pid, cmd=cmd, log=str(self.log_path))
                self.emit(Event.ROUTER_PROCESS, action="spawned", pid=proc.pid)
                return proc
        log.error("router.start_failed", error=self.error, router=self.rcfg.url)
        self.emit(Event.ROUTER_PROCESS, action="start_failed", error=self.error)
        return None

    async def _stop_orphan(self, port: int) -> bool:
        """The port is held by a router of ours that no journal names (a daemon killed as it
        spawned it, a journal lost): stopped as an orphaned engine is. True if one was."""
        st = router_of_ours_on(port)
        if st is None:
            return False
        how = await stop_group_of(st.pid, st.start_time, self.cfg.stop_timeout)
        log.warning("router.orphan_stopped", pid=st.pid, port=port, how=how,
                    why="a router of ours that no journal names held the port; a fresh one is started")
        self.emit(Event.ROUTER_PROCESS, action="orphan_stopped", pid=st.pid, how=how)
        return True

    def _startup_bound(self) -> float:
        return max(STARTUP_BOUND, self.rcfg.silent_timeout)

    async def _serving(self, proc: ChildProcess) -> bool:
        """While it runs, asked every SERVING_POLL: True once it exits by itself; False once it
        has answered nothing for silent_timeout (hung, or SIGSTOPped: /proc shows it running)."""
        exited = asyncio.ensure_future(proc.wait())
        silent_since: float | None = None
        try:
            while True:
                await asyncio.wait({exited}, timeout=SERVING_POLL)
                if exited.done():
                    return True
                if await self.answers():
                    silent_since = None
                    continue
                silent_since = self.clock() if silent_since is None else silent_since
                if self.clock() - silent_since >= self.rcfg.silent_timeout:
                    return False
        finally:
            exited.cancel()

    async def _until_answered(self, proc: ChildProcess) -> bool:
        """True once the router answers its admin API; False if it exits first, or stays
        silent for its startup bound (STARTUP_BOUND, or silent_timeout if longer)."""
        deadline = self.clock() + self._startup_bound()
        exited = asyncio.ensure_future(proc.wait())
        try:
            while True:
                if await self.answers():
                    return True
                if exited.done() or self.clock() > deadline:
                    return False
                await asyncio.wait({exited}, timeout=ANSWER_POLL)
        finally:
            exited.cancel()

    def _set(self, state: str) -> None:
        self.state = state

    async def detach(self) -> None:
        """A reload: end the supervision, leave the router running for the next image to adopt
        (the journal's last write still names it)."""
        await cancel_and_wait(self._task)
        self._task = None

    async def stop(self) -> None:
        """The daemon's shutdown, after the engines: end the supervision, then stop the group."""
        await cancel_and_wait(self._task)
        self._task = None
        proc, self.proc = self.proc, None
        if proc is None:
            self._set("stopped")
            return
        self._set("stopping")
        how = await proc.stop(self.cfg.stop_timeout)
        self._set("stopped")
        self.up.clear()
        self.persist()
        log.info("router.stopped", pid=proc.pid, how=how)
        self.emit(Event.ROUTER_PROCESS, action="stopped", pid=proc.pid, how=how)

    # -- what status and metrics read ------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {"pid": self.proc.pid if self.proc is not None else None, "state": self.state,
                "adopted": self.adopted, "restarts": self.restarts.count, "error": self.error,
                "log": str(self.log_path)}

    def families(self) -> Iterator[Metric]:
        yield CounterMetricFamily("vime_router_restarts", "Times the spawned router was started again after it ended",
                                  value=self.restarts.count)
        yield GaugeMetricFamily("vime_router_process_up", "1 while the spawned router runs and has answered",
                                value=1 if self.up.is_set() else 0)


async def _never() -> bool:
    return False


def _rotate(path: Path) -> None:
    """One older log kept: router.log is appended to across restarts, moved aside when large."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.stat().st_size > LOG_ROTATE_BYTES:
            os.replace(path, path.with_name(path.name + ".1"))
    except OSError:
        pass


async def stop_leftover(entry: dict[str, Any], *, same_boot: bool, timeout: float) -> None:
    """A router a previous daemon spawned that this config does not spawn: stopped if it is
    still that very process."""
    pid, start_time = int(entry["pid"]), int(entry["start_time"])
    verdict, why = judge_router(entry, same_boot=same_boot, unwanted=router_unwanted(entry, None))
    if verdict == STOP:
        how = await stop_group_of(pid, start_time, timeout)
        log.warning("router.not_adopted", pid=pid, why=why, action=f"stopped its process group ({how})")
