"""The daemon: `vime-supervisor --config FILE [flags]` (or `python -m supervisor`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import structlog
import uvloop

from . import config as config_mod
from . import logs
from . import journal as journal_mod
from .config import Config, ConfigError
from .control import ControlServer
from .engine import EngineRunner
from .fleet import Fleet
from .fsm import vlabel
from .journal import JournalError, JournalWriter
from .process import kill_group_of
from .sdnotify import Notifier
from .states import State

log = structlog.get_logger("vime.supervisor")

DEFAULT_CONFIG = "/etc/vime-supervisor/config.toml"


class Supervisor:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.fleet = Fleet(cfg)
        self.notifier = Notifier()
        self.journal = JournalWriter(self.fleet, Path(cfg.state_dir) / "journal.json")
        self.fleet.persist = self.journal.flush
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def request_stop(self, why: str) -> None:
        if not self._stop.is_set():
            self._stop.set()  # first: a log write can fail (a closed stderr) but must not block the stop
            log.info("supervisor.stop_requested", why=why)

    async def run(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        os.makedirs(cfg.log_dir, exist_ok=True)
        os.makedirs(cfg.runtime_dir, exist_ok=True)
        # One session for every probe. No total cap (the fleet can be large); per engine a few
        # connections: a heartbeat, the /metrics read beside it, a version check.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=4)
        async with aiohttp.ClientSession(connector=connector) as session:
            n = len(cfg.engines)
            for i, spec in enumerate(cfg.engines):
                # Spread probes over the interval instead of firing them all at once.
                runner = EngineRunner(spec, cfg, self.fleet, session, phase=cfg.probe.interval * i / n)
                self.fleet.runners[spec.name] = runner
            self._restore()
            control = ControlServer(self.fleet, cfg.socket_path, allowed_uids=cfg.allowed_uids,
                                    socket_group=cfg.socket_group or None)
            await control.start()
            log.info("supervisor.started", pid=os.getpid(), socket=cfg.socket_path, engines=[s.name for s in cfg.engines],
                     fault_tolerance=cfg.use_fault_tolerance, interval=cfg.probe.interval,
                     timeout=cfg.probe.timeout, failure_threshold=cfg.probe.failure_threshold,
                     first_wait=cfg.probe.first_wait)
            self.journal.start()
            self._tasks = [asyncio.create_task(self._follow_fleet(), name="follow-fleet"),
                           asyncio.create_task(self._ready_when_checked(), name="sd-ready")]
            if self.notifier.watchdog_interval:
                self._tasks.append(asyncio.create_task(self._watchdog(), name="sd-watchdog"))
            for runner in self.fleet.runners.values():
                if not runner.retired:
                    runner.start()
            try:
                await self._stop.wait()
                self.notifier.stopping()
                await self.shutdown()
            finally:
                for t in self._tasks:
                    t.cancel()
                await control.stop()
                await self.fleet.sync.close()
                await self.journal.close()
                self.notifier.close()

    def _restore(self) -> None:
        """Pick up where a previous daemon left off: round, version, engines still running."""
        path = self.journal.path
        try:
            data = journal_mod.load(path)
        except JournalError as e:
            bad = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            os.replace(path, bad)
            log.error("journal.unusable", error=str(e), moved_to=str(bad), action="clean start")
            return
        if data is None:
            log.info("journal.none", path=str(path), action="clean start")
            return
        fleet = self.fleet
        fleet.round, fleet.round_open = data.get("round"), bool(data.get("round_open"))
        fleet.current_version, fleet.checkpoint = data.get("weight_version"), data.get("checkpoint")
        adopted, fresh = [], []
        for name, entry in data["engines"].items():
            runner = fleet.runners.get(name)
            if runner is None:
                if entry.get("pid"):
                    log.warning("journal.unknown_engine", engine=name, pid=entry["pid"],
                                hint="no longer in the config; stop it by hand if it still runs")
                continue
            runner.retired = bool(entry.get("retired"))
            runner.start_stopped = entry.get("state") == State.STOPPED.value
            if runner.spec.spawned and entry.get("pid"):
                if runner.adopt(entry):
                    adopted.append(name)
                else:
                    fresh.append(name)
                    kill_group_of(int(entry["pid"]), int(entry.get("start_time", 0)))  # its leftovers
        log.info("journal.restored", round=fleet.round, round_open=fleet.round_open,
                 weight_version=fleet.current_version, adopted=adopted, gone=fresh)

    async def _follow_fleet(self) -> None:
        """Every fleet change: the journal and systemd's STATUS= follow."""
        while True:
            sub = self.fleet.subscribe()
            try:
                while not sub.lost:
                    await sub.queue.get()
                    self.journal.mark()
                    self.notifier.status(status_line(self.fleet))
            finally:
                self.fleet.unsubscribe(sub)

    async def _ready_when_checked(self) -> None:
        """READY=1 once the socket listens and every engine's first start has concluded."""
        def first_start_pending(r) -> bool:
            return not r.retired and (r.fsm.state is State.STARTING
                                      or r.fsm.state is State.STOPPED and r.fsm.incarnation == 0
                                      and not r.start_stopped)

        while any(first_start_pending(r) for r in self.fleet.runners.values()):
            await asyncio.sleep(0.2)
        self.notifier.ready(status_line(self.fleet))
        log.info("supervisor.ready", status=status_line(self.fleet))

    async def _watchdog(self) -> None:
        # From the event loop itself: if the loop is wedged, systemd stops hearing from us.
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_interval)

    async def shutdown(self) -> None:
        """Stop every engine in parallel, bounded: stop_timeout covers SIGTERM->SIGKILL."""
        runners = list(self.fleet.runners.values())
        log.info("supervisor.stopping", engines=len(runners))
        results = await asyncio.gather(*(r.shutdown() for r in runners), return_exceptions=True)
        for r, res in zip(runners, results):
            if isinstance(res, BaseException):
                log.error("supervisor.stop_failed", engine=r.name, error=repr(res))
        log.info("supervisor.stopped")


def status_line(fleet: Fleet) -> str:
    """systemd's STATUS=: `7/8 engines RUNNING, round 412, weights v118`."""
    runners = list(fleet.runners.values())
    running = sum(r.fsm.state is State.RUNNING for r in runners)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = config_mod.load(args.config, args)
    except ConfigError as e:
        for problem in e.problems:
            print(f"vime-supervisor: config error: {problem}", file=sys.stderr)
        print(f"vime-supervisor: {len(e.problems)} problem(s) in {args.config}; nothing was started",
              file=sys.stderr)
        return 2
    if args.check_config:
        print(f"{args.config}: ok, {len(cfg.engines)} engine(s)")
        return 0
    logs.configure(cfg.log_level)
    uvloop.run(Supervisor(cfg).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
