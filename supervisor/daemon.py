"""The daemon: `vime-supervisor --config FILE [flags]` (or `python -m vime.supervisor`).

`Supervisor` is the composition root: it builds every part, hands each what it needs, wires the
bus's listeners in order and owns every long-lived task in one `TaskSet`. Its object graph is
in docs/architecture.md (checked by tests/unit/test_architecture_doc.py).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable

import aiohttp
import structlog
import uvloop

from . import config as config_mod
from . import logs
from . import journal as journal_mod
from . import limits
from . import reexec
from .config import Config, ConfigError, ConfigReadError
from .control import ControlServer
from .engine.runner import EngineRunner
from .events import EventBus
from .fleet import Fleet
from .engine.fsm import vlabel
from .journal import JournalWriter
from .metrics import FleetStats, MetricsServer
from .policy import FleetPolicy
from .engine.process import engine_fingerprint
from .protocol import Event
from .restore import restore
from .router.child import STARTUP_BOUND, RouterChild
from .router.feed import RouterFeed
from .router.link import RouterLink
from .sdnotify import Notifier
from .selfwatch import SelfWatch
from .states import State
from .sync import PushCoordinator, SyncCoordinator
from .tasks import TaskSet, cancel_and_wait, wait_event

log = structlog.get_logger("vime.supervisor")

DEFAULT_CONFIG = "/etc/vime-supervisor/config.toml"
# After a reload or a daemon restart, how long the socket waits for the adopted engines' first
# check (a healthy one answers in milliseconds); clients retry their connect for 10 s by default.
RELOAD_SETTLE = 5.0
EXTEND_WINDOW = 30.0  # seconds each EXTEND_TIMEOUT_USEC buys while first starts run


class Supervisor:
    def __init__(self, cfg: Config, *, generation: int = 0, reread: Callable[[], Config] | None = None,
                 listening: socket.socket | None = None):
        self.cfg = cfg
        # The listening control socket: handed over by a reload, served on by run(), and after
        # a run that ends in a reload, still listening for the next image (None otherwise).
        self.listener = listening
        self.reread = reread  # the config file read again, as a reload's next image will read it
        self.generation = generation  # reloads (re-executions in place) this process has been through
        self.bus = EventBus()
        self.policy = FleetPolicy(min_healthy=cfg.min_healthy, use_fault_tolerance=cfg.use_fault_tolerance,
                                  restart_immediately=cfg.restart_immediately,
                                  admit_mid_round=cfg.admit_mid_round, strength=len(cfg.engines) - cfg.spares,
                                  target=len(cfg.engines) - cfg.spares if cfg.spares else None,
                                  rule=cfg.weights.rule)
        self.stats = FleetStats(self.bus)
        # [router]: its one owner (the feed, the spawned child, the session to its admin API),
        # handed to the fleet, the journal, status and the metrics.
        self.router = (RouterLink(cfg, self.bus.emit, lambda: self.journal.flush())
                       if cfg.router is not None else None)
        self.fleet = Fleet(cfg, policy=self.policy, bus=self.bus, stats=self.stats, router=self.router)
        self.fleet.reloads = generation
        self.sync = SyncCoordinator(self.fleet, cfg.sync_timeout)
        self.pushes = PushCoordinator(self.fleet, grace=cfg.probe.interval + cfg.probe.timeout)
        # In this order: the statistics see a transition before the routing change it causes
        # (a recovery is timed from the detection), and the sync coordinator considers an
        # engine once the fleet has settled its routing. (DETECTION is on the stream before
        # its transition whatever the order: the runner emits it as it hands the transition on.)
        for listener in (self.stats, self.fleet, self.sync, self.pushes):
            self.bus.add_listener(listener)
        self.notifier = Notifier()
        self.selfwatch = SelfWatch(self.notifier.watchdog_interval)  # loop lag, watchdog lateness, started
        self.journal = JournalWriter(self.fleet, Path(cfg.state_dir) / "journal.json", router=self.router)
        self.fleet.persist = self.journal.flush
        self._stop = asyncio.Event()
        self._reload = False  # set once a reload's checks passed: the stop detaches instead
        self._stop_wanted = False  # a stop asked for (SIGTERM): wins over a reload
        self._reloading: asyncio.Task[None] | None = None
        self.tasks = TaskSet("daemon")  # every long-lived task of the daemon
        self._feed_task: asyncio.Task[None] | None = None

    @property
    def router_feed(self) -> RouterFeed | None:
        return self.router.feed if self.router is not None else None

    @property
    def router_child(self) -> RouterChild | None:
        """[router] spawn: the router runs as our child, journaled and adopted like an engine."""
        return self.router.child if self.router is not None else None

    def request_stop(self, why: str) -> None:
        self._stop_wanted = True
        if not self._stop.is_set():
            self._stop.set()  # first: a log write can fail (a closed stderr) but must not block the stop
            log.info("supervisor.stop_requested", why=why)

    def request_reload(self) -> None:
        """SIGHUP: re-execute in place once the checks pass (see reexec.py); one at a time."""
        if self._stop.is_set():
            log.warning("supervisor.reload_ignored", why="the daemon is already stopping")
        elif self._reloading is not None and not self._reloading.done():
            log.info("supervisor.reload_ignored", why="a reload is already under way")
        else:
            self._reloading = self.tasks.spawn(self._prepare_reload(), name="reload")

    async def _prepare_reload(self) -> None:
        argv = reexec.daemon_argv()
        log.info("supervisor.reload_requested", argv=argv, generation=self.generation)
        self.notifier.reloading()
        # Syncs first: the check then runs last, just before the exec, so the config the next
        # image reads is the one checked (an edit in between is a window of a second, not of
        # sync_timeout).
        why = await self._wait_for_syncs()
        if why is None:
            (n, attached) = limits.fleet_counts(self.cfg.engines)
            held = limits.nofile_needed(n, self.cfg.warmup.requests, attached=attached)
            why = await reexec.preflight(argv, held=held)
        if why is None:
            why = await asyncio.to_thread(self._moved_dirs)
        if why is None:  # a sync that began while the check ran ends first too
            why = await self._wait_for_syncs()
        if why is not None:
            log.error("supervisor.reload_refused", why=why,
                      action="the running daemon goes on unchanged; fix the cause and reload again")
            self.fleet.emit(Event.RELOAD_REFUSED, why=why)
            self.notifier.ready(status_line(self.fleet))  # back from RELOADING, as we were
            return
        if not self._stop.is_set():
            await self._drain_leaving()
        if not self._stop.is_set():  # a stop that came during the drain wins: no reload
            self._reload = True
            self._stop.set()

    def _leaving_on_reload(self) -> list[EngineRunner]:
        """The engines the next image will stop: no longer in the config, now attached or
        spawned at another URL, or spawned with another command (model, port, args, env)."""
        if self.reread is None:
            return []
        try:
            new = self.reread()
        except ConfigError:
            return []  # as _moved_dirs: the installed daemon accepted what this image cannot read
        specs = {spec.name: spec for spec in new.engines}
        out = []
        for r in self.fleet.runners.values():
            spec = specs.get(r.name)
            if (spec is None or spec.spawned != r.spec.spawned or spec.base_url != r.spec.base_url
                    or r.spec.spawned and engine_fingerprint(spec, new) != engine_fingerprint(r.spec, self.cfg)):
                out.append(r)
        return out

    async def _drain_leaving(self) -> None:
        """A planned stop, as `supervisorctl stop` is: each engine the next image will stop
        leaves the router and its requests in flight end (drain_timeout) before the exec. The
        next image would otherwise stop it with its URL still listed, and a URL no longer in the
        config is no daemon's to remove."""
        link = self.router
        if link is None or not link.drains():
            return
        leaving = [r for r in self._leaving_on_reload() if r.serving or self.fleet.is_routable(r)]
        if not leaving:
            return
        log.info("supervisor.reload_drains", engines=[r.name for r in leaving],
                 why="stopped or changed by the new config: out of the router first")
        done = await asyncio.gather(*(link.drain(r) for r in leaving), return_exceptions=True)
        for r, what in zip(leaving, done):
            log.info("supervisor.reload_drained", engine=r.name, result=str(what))

    def _moved_dirs(self) -> str | None:
        """A reload keeps the state and runtime directories: the journal (the round, the version,
        the engines' pids) and the locks live there. Why not, if the new config moves them."""
        if self.reread is None:
            return None
        try:
            new = self.reread()
        except ConfigError as e:
            # The installed daemon accepted it (a key this code does not know): its own
            # directories cannot be compared here.
            log.warning("supervisor.reload_unchecked", why=f"this image cannot read the new config: {e}")
            return None
        for key in ("state_dir", "runtime_dir"):
            old_dir, new_dir = getattr(self.cfg, key), getattr(new, key)
            if os.path.realpath(old_dir) != os.path.realpath(new_dir):
                return (f"{key} changed from {old_dir} to {new_dir}; a reload keeps the journal and the locks "
                        f"where they are. Put {key} back and reload, or stop the daemon, move "
                        f"{old_dir}'s contents to {new_dir} and start it")
        return None

    async def _wait_for_syncs(self) -> str | None:
        """A reload lets weight syncs in flight end (their watchdog bounds them by sync_timeout),
        and announced pushes too (each ends, or expires past its deadline): an engine caught
        SYNCING would not be adopted but restarted, and the next image would not know a push
        its receivers are paused for. None once none is left."""
        def syncing() -> list[str]:
            return [r.name for r in self.fleet.runners.values() if r.state is State.SYNCING]

        def pushing() -> list[str]:
            return [p.id for p in self.pushes.book.in_flight()]

        # Bounded by what is in flight now: a push announced while waiting is waited for only
        # within that bound (a trainer pushing back to back would otherwise hold the reload).
        bound = max(self.cfg.sync_timeout + 5.0, self.pushes.book.wait_bound() + 1.0)
        deadline = time.monotonic() + bound
        if syncing() or pushing():
            log.info("supervisor.reload_waits", syncing=syncing(), pushes=pushing(),
                     why="weight syncs and announced pushes in flight end first")
        while syncing() or pushing():
            if time.monotonic() > deadline:
                if syncing():
                    return f"engines still SYNCING after sync_timeout ({self.cfg.sync_timeout:g}s): {syncing()}"
                return f"announced pushes still in flight after {bound:g}s: {pushing()}; reload in a gap between pushes"
            await asyncio.sleep(0.1)
        return None

    async def run(self) -> bool:
        """Supervise until stopped. True: the engines were detached for a reload, and the caller
        execs the daemon again; False: they were stopped."""
        cfg = self.cfg
        self._take_signals()
        os.makedirs(cfg.log_dir, exist_ok=True)
        os.makedirs(cfg.runtime_dir, exist_ok=True)
        # One session for every probe. No total cap (the fleet can be large); per engine a few
        # connections: a heartbeat, the /metrics read beside it, a version check.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=4)
        # The engines' API key on every request (vLLM 0.32 asks for it on /v1 only; harmless elsewhere).
        async with aiohttp.ClientSession(connector=connector, headers=cfg.engine_headers) as session:
            self._add_runners(session)
            await self._start_supervision(session)
            control = ControlServer(self.fleet, self.sync, cfg.socket_path, allowed_uids=cfg.allowed_uids,
                                    socket_group=cfg.socket_group or None, listener=self.listener,
                                    pushes=self.pushes, router=self.router)
            self.listener = None  # the control server's now
            metrics = MetricsServer(self.fleet, cfg.metrics_address, self.router, self.selfwatch)  # "": none
            try:
                await control.start()
                await metrics.start()
                log.info("supervisor.started", pid=os.getpid(), socket=cfg.socket_path,
                         engines=[s.name for s in cfg.engines], generation=self.generation,
                         fault_tolerance=cfg.use_fault_tolerance, interval=cfg.probe.interval,
                         timeout=cfg.probe.timeout, failure_threshold=cfg.probe.failure_threshold,
                         first_wait=cfg.probe.first_wait)
                self.tasks.spawn(self._ready_when_checked(), name="sd-ready")
                await self._until_stopped()
            finally:
                await self._close(control, metrics)
        if self._reload:
            # From here a stop stays pending (blocked) and reaches the next image's handler:
            # past this loop nobody would run ours (uvloop's would swallow it). One that came
            # just before is read from the loop's wakeup fd first.
            reexec.hold_signals()
            await asyncio.sleep(0.05)
        if self._reload and self._stop_wanted:  # a stop in the last moments before the exec
            self._reload = False
            await self.shutdown()
        if not self._reload:
            control.close_listener()
            self.listener = None
        return self._reload

    def _take_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        reexec.release_signals()  # what a reload held across its exec is delivered now

    def _add_runners(self, session: aiohttp.ClientSession) -> None:
        cfg = self.cfg
        n = len(cfg.engines)
        for i, spec in enumerate(cfg.engines):
            # Spread probes over the interval instead of firing them all at once.
            runner = EngineRunner(spec, cfg, self.policy, self.bus, session, phase=cfg.probe.interval * i / n,
                                  persist=self.journal.write)
            runner.verify_content = self.fleet.verify_content  # by what it computes (docs/weights.md#fingerprints)
            if cfg.restart_load == "dummy":
                # Only with someone to push every tensor, into a version that can be verified.
                runner.may_load_dummy = lambda: self.sync.agents > 0 and self.policy.current_version is not None
            self.fleet.runners[spec.name] = runner

    async def _start_supervision(self, session: aiohttp.ClientSession) -> None:
        """What a previous daemon left is adopted or stopped, then every task starts: the
        journal, STATUS=, the watchdog, the engines, the router."""
        await restore(self.fleet, self.cfg, self.journal.path, generation=self.generation, router=self.router)
        if self.router is not None:
            self.router.start(self.fleet, self.bus, session, self.tasks)
        self.journal.start(self.tasks)
        self.tasks.spawn(self._follow_fleet(), name="follow-fleet")
        if self.notifier.watchdog_interval:
            self.tasks.spawn(self._watchdog(self.notifier.watchdog_interval), name="sd-watchdog")
        self.tasks.spawn(self.selfwatch.loop.run(), name="loop-lag")
        for runner in self.fleet.runners.values():
            if not runner.retired:
                runner.start(self.tasks)
        # After a reload or a daemon restart the socket is served once the adopted engines
        # are checked again, so a call sees the fleet as the previous daemon left it, never
        # empty while they are checked: a rollout client that read an empty list would fail
        # every request it holds. Meanwhile a call waits in the backlog (a reload) or its
        # connect is refused and retried, and clients keep the membership they last read.
        await self._readopted(RELOAD_SETTLE)
        if self.router_feed is not None:
            self._feed_task = self.tasks.spawn(self._feed_router(self.router_feed), name="router-feed")

    async def _until_stopped(self) -> None:
        await self._stop.wait()
        if self._reload and not self._stop_wanted:
            await self.detach()
        if not self._reload or self._stop_wanted:
            # A stop wins over a reload, even one that came while detaching: the
            # engines are still ours to stop, not to hand over.
            self._reload = False
            self.notifier.stopping()
            await self.shutdown()

    async def _close(self, control: ControlServer, metrics: MetricsServer) -> None:
        # In this order: engines are stopped (above), the socket closes (for a reload it
        # stops accepting and stays listening), syncs end, the journal's last write,
        # then whatever task is left.
        await control.stop(keep_listening=self._reload and reexec.socket_handover_enabled())
        self.listener, self.listener_file = control.listener, control.listener_file
        await metrics.stop()
        await self.sync.close()
        await self.pushes.close()
        await self.journal.close()
        await self.tasks.aclose()
        if self.router is not None:
            await self.router.close()
        self.notifier.close()

    async def detach(self) -> None:
        """A reload: end supervision of every engine, leaving its process running; the
        journal's last write (in run()) names each one for the next image to adopt."""
        runners = list(self.fleet.runners.values())
        log.info("supervisor.detaching", engines=len(runners), round=self.fleet.round,
                 round_open=self.fleet.round_open, weight_version=self.fleet.current_version)
        await asyncio.gather(*(r.detach() for r in runners))
        if self.router is not None:  # a spawned router is left running: the next image adopts it too
            await self.router.detach()

    async def _feed_router(self, feed: RouterFeed) -> None:
        """The router is fed once the engines adopted from the journal (after a reload or a
        crash) have been checked again: healthy ones are never taken out on the way. At most
        as long as a hang takes to judge; past that, what is known is fed."""
        probe = self.cfg.probe
        if self.router_child is not None and not await self.router_child.answered(STARTUP_BOUND):
            log.warning("router.not_up", bound=STARTUP_BOUND, action="fed once it answers; supervision goes on")
        await self._readopted(RELOAD_SETTLE + probe.hang_bound(probing_now=True),
                              then="the router is fed now; they go on being checked")
        await feed.run()

    async def _readopted(self, bound: float, then: str = "the socket opens now; they go on being checked") -> None:
        """Until every engine being re-adopted has been checked again, at most `bound` s."""
        runners = [r for r in self.fleet.runners.values() if not r.retired]
        deadline = time.monotonic() + bound
        while True:
            changes = [r.next_change() for r in runners]  # taken before the check: no change is missed
            pending = [r.name for r in runners if r.readopting]
            left = deadline - time.monotonic()
            if not pending:
                return
            if left <= 0:
                log.warning("supervisor.readoption_slow", bound=bound, engines=pending, action=then)
                return
            waits = [asyncio.ensure_future(c.wait()) for c in changes]
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def _follow_fleet(self) -> None:
        """Every fleet change: the journal and systemd's STATUS= follow."""
        while True:
            sub = self.fleet.subscribe()
            try:
                while not sub.lost:
                    await sub.queue.get()
                    while not sub.queue.empty():  # one status line for what came at once (it reads every engine)
                        sub.queue.get_nowait()
                    self.journal.mark()
                    self.notifier.status(status_line(self.fleet))
            finally:
                self.fleet.unsubscribe(sub)

    async def _ready_when_checked(self) -> None:
        """READY=1 once the socket listens and every engine's first start has concluded."""
        def first_start_pending(r: EngineRunner) -> bool:
            return not r.retired and (r.state is State.STARTING
                                      or not r.first_start_begun and not r.start_stopped)

        # One engine waited on at a time, in order: waiting on every engine's change at each
        # change was O(N^2) while N engines came up. A last look over all of them catches one
        # that went back to STARTING (a restart) behind the one waited on.
        runners = list(self.fleet.runners.values())
        i = 0
        while True:
            while i < len(runners) and not first_start_pending(runners[i]):
                i += 1
            if i == len(runners):
                i = next((k for k, r in enumerate(runners) if first_start_pending(r)), i)
                if i == len(runners):
                    break
            change = runners[i].next_change()  # taken before the check: no change is missed
            if not first_start_pending(runners[i]):
                continue
            # First starts may outlast TimeoutStartSec (a cold compile, a large model): each
            # message buys EXTEND_WINDOW more, and one is due before that runs out. A daemon
            # that stops sending (wedged) still fails the start.
            self.notifier.extend_timeout(EXTEND_WINDOW)
            await wait_event(change, EXTEND_WINDOW / 3)
        self.selfwatch.started = True
        self.notifier.ready(status_line(self.fleet))
        log.info("supervisor.ready", status=status_line(self.fleet))

    async def _watchdog(self, interval: float) -> None:
        # From the event loop itself: if the loop is wedged, systemd stops hearing from us.
        while True:
            self.notifier.watchdog()
            await self.selfwatch.watchdog.sleep(interval)  # how late the next ping goes out

    async def shutdown(self) -> None:
        """Stop every engine in parallel, bounded: stop_timeout covers SIGTERM->SIGKILL."""
        runners = list(self.fleet.runners.values())
        log.info("supervisor.stopping", engines=len(runners))
        link = self.router
        if link is not None and link.open():
            # A planned stop: every engine out of the router, its requests end
            await asyncio.gather(*(link.drain(r) for r in runners
                                   if r.serving or self.fleet.is_routable(r)), return_exceptions=True)
        results = await asyncio.gather(*(r.shutdown() for r in runners), return_exceptions=True)
        for r, res in zip(runners, results):
            if isinstance(res, BaseException):
                log.error("supervisor.stop_failed", engine=r.name, error=repr(res))
        if link is not None and link.child is not None:
            # Last: every engine is out of its list and stopped. The feed ends first (it would
            # only see the router go), once the removals it has in flight are answered.
            await cancel_and_wait(self._feed_task)
            await link.stop()
        log.info("supervisor.stopped")


def status_line(fleet: Fleet) -> str:
    """systemd's STATUS=: `7/8 engines RUNNING, round 412, weights v118`."""
    runners = list(fleet.runners.values())
    running = sum(r.state is State.RUNNING for r in runners)
    rnd = "no round yet" if fleet.round is None else f"round {fleet.round}{'' if fleet.round_open else ' ended'}"
    return f"{running}/{len(runners)} engines RUNNING, {rnd}, weights {vlabel(fleet.current_version)}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="vime-supervisor",
        description="Supervise vLLM rollout engines: probe them, stop hung ones, restart dead ones.",
    )
    ap.add_argument("-c", "--config", default=os.environ.get("VIME_SUPERVISOR_CONFIG", DEFAULT_CONFIG),
                    help=f"TOML config file (default $VIME_SUPERVISOR_CONFIG or {DEFAULT_CONFIG})")
    ap.add_argument("--check-config", action="store_true", help="validate the config and exit")
    config_mod.add_flags(ap)
    return ap.parse_args(argv)


class LockError(Exception):
    pass


def acquire_locks(cfg: Config, inherited: dict[str, int] | None = None) -> list[int]:
    """One daemon per runtime and state directory: an flock on `supervisor.lock` in each,
    held (fds open, not inherited by engines) until the process ends, so a kill -9 frees it.
    A second daemon gets LockError before it touches the socket, the journal or an engine.
    `inherited`: lock fds a reload handed over (path -> fd), still holding their flocks."""
    fds: list[int] = []
    seen: set[str] = set()
    inherited = dict(inherited or {})
    for d in (cfg.state_dir, cfg.runtime_dir):
        try:
            os.makedirs(d, exist_ok=True)
            real = os.path.realpath(d)
            if real in seen:  # one lock per directory: a second flock of ours would conflict
                continue
            seen.add(real)
            path = os.path.join(real, "supervisor.lock")
            fd = inherited.pop(path, None)
            if fd is None:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise LockError(f"cannot create the lock file in {d}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            except OSError:
                holder = "unknown"
            os.close(fd)
            for f in fds:
                os.close(f)
            raise LockError(f"another daemon (pid {holder}) already runs with {d} (it holds {path}); "
                            "nothing was started and its socket was left alone. Stop that daemon first, "
                            "or give this one its own runtime_dir and state_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        fds.append(fd)
    for fd in inherited.values():  # a directory the reloaded config no longer uses
        os.close(fd)
    return fds


def main(argv: list[str] | None = None) -> int:
    handover = reexec.inherited()  # first: engines must not inherit the variable
    # A SIGHUP before the event loop handles it would kill the daemon (its default action).
    early_hup: list[int] = []
    signal.signal(signal.SIGHUP, lambda signum, frame: early_hup.append(signum))
    args = parse_args(argv)
    cfg = load_config(args)
    if cfg is None:
        return 2
    if args.check_config:
        return check_config(args, cfg)
    try:
        locks = acquire_locks(cfg, handover.locks if handover else None)
    except LockError as e:
        print(f"vime-supervisor: {e}", file=sys.stderr)
        return 1
    logs.configure(cfg.log_level)
    for warning in cfg.warnings:
        log.warning("config.warning", config=args.config, warning=warning)
    if not open_files_allow_start(cfg, handover):
        for fd in locks:
            os.close(fd)
        return 2
    try:
        return supervise(cfg, args, handover, locks, early_hup)
    finally:
        for fd in locks:
            os.close(fd)


def load_config(args: argparse.Namespace) -> Config | None:
    """The config, or None once its problems are printed (exit 2)."""
    try:
        return config_mod.load(args.config, args)
    except ConfigReadError as e:  # no file to judge: its one line says why
        print(f"vime-supervisor: config error: {e.problems[0]}", file=sys.stderr)
        return None
    except ConfigError as e:
        for message in e.problems:
            print(f"vime-supervisor: config error: {message}", file=sys.stderr)
        print(f"vime-supervisor: {len(e.problems)} problem(s) in {args.config}; nothing was started",
              file=sys.stderr)
        return None


def check_config(args: argparse.Namespace, cfg: Config) -> int:
    """--check-config: 0 if the config is good, 2 if not (each problem printed)."""
    for warning in cfg.warnings:
        print(f"vime-supervisor: config warning: {warning}", file=sys.stderr)
    # The open-file limit against the fleet: the hard one caps what start-up can raise
    # the soft one to (an error), the soft one is what this shell would start with.
    (n, attached), warm = limits.fleet_counts(cfg.engines), cfg.warmup.requests
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    problem = limits.nofile_problem(n, hard, hard=True, warmup_requests=warm, attached=attached)
    held = reexec.reload_held(os.environ.get(reexec.RELOAD_CHECK_ENV))
    if problem and limits.nofile_needed(n, warm, attached=attached) <= held:
        # A reload's check: the new image re-adopts the running fleet and starts under this
        # limit (as any daemon with engines to adopt does); a config that needs no more than
        # the running one goes ahead. One that needs more is refused, as a fresh start is.
        print(f"vime-supervisor: config warning: {problem}; a reload re-adopts the running engines "
              "and goes ahead", file=sys.stderr)
    elif problem:
        print(f"vime-supervisor: config error: {problem}", file=sys.stderr)
        return 2
    problem = limits.nofile_problem(n, soft, warmup_requests=warm, attached=attached)
    if problem:
        print(f"vime-supervisor: config warning: {problem}", file=sys.stderr)
    print(f"{args.config}: ok, {len(cfg.engines)} engine(s)")
    return 0


def open_files_allow_start(cfg: Config, handover: reexec.Handover | None) -> bool:
    """Raise the open-file limit for the fleet; False if it is too low to start at all (nothing
    runs yet: --check-config's error, exit 2, no restart loop)."""
    soft, hard = limits.raise_nofile()  # about one descriptor per engine, more while they warm up
    (n, attached), warm = limits.fleet_counts(cfg.engines), cfg.warmup.requests
    need = limits.nofile_needed(n, warm, attached=attached)
    log.info("limits.nofile", soft=soft, hard=hard, needed=need, engines=len(cfg.engines))
    adopting = journal_mod.engines_to_adopt(Path(cfg.state_dir) / "journal.json")
    may_start, short = limits.start_problem(n, hard, warmup_requests=warm, attached=attached, adopting=adopting)
    if not may_start and handover is None:
        log.error("limits.nofile_refused", problem=short)
        print(f"vime-supervisor: config error: {short}; nothing was started", file=sys.stderr)
        return False
    short = short or limits.nofile_problem(n, soft, warmup_requests=warm, attached=attached)
    if short:
        log.error("limits.nofile_low", problem=short)
    return True


def supervise(cfg: Config, args: argparse.Namespace, handover: reexec.Handover | None, locks: list[int],
              early_hup: list[int]) -> int:
    """Run the daemon; after each run that ends in a reload, exec the new image (or, if the
    exec fails, adopt the engines again in this process)."""
    generation = handover.generation if handover else 0
    listener = handover.listener if handover else None
    if handover and handover.listener_refused:
        log.warning("control.handover_refused", why=handover.listener_refused, action="binding a fresh socket")
    kept: list[Supervisor] = []
    while True:
        sup = Supervisor(cfg, generation=generation, reread=lambda: config_mod.load(args.config, args),
                         listening=listener)
        listener = None
        if early_hup:
            log.warning("supervisor.reload_ignored", why="SIGHUP before the daemon was up")
            early_hup.clear()
        if not uvloop.run(sup.run()):
            return 0
        argv_now = reexec.daemon_argv()
        log.info("supervisor.reexec", argv=argv_now, generation=generation + 1)
        listener, named = sup.listener, None
        if listener is not None:
            try:
                named = reexec.socket_identity(listener, cfg.socket_path, sup.listener_file)
            except OSError as e:  # its file is gone or replaced: the next image binds a fresh one
                log.warning("control.not_handed_over", socket=cfg.socket_path, why=str(e))
                listener.close()
                listener = None
        try:
            reexec.execute(argv_now, generation + 1, locks, named)  # returns only if it failed
        except OSError as e:
            # The engines run on, detached and journaled: this process adopts them again,
            # with the code it already has (nothing of the old image is dropped: kept),
            # serving on the socket it kept listening.
            log.error("supervisor.reload_failed", error=str(e), argv=argv_now,
                      action="re-adopting the engines with the daemon already running")
            kept.append(sup)
            generation += 1

if __name__ == "__main__":
    sys.exit(main())
