"""The daemon: `vime-supervisor --config FILE [flags]` (or `python -m supervisor`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import aiohttp
import structlog
import uvloop

from . import config as config_mod
from . import logs
from .config import Config, ConfigError
from .control import ControlServer
from .engine import EngineRunner
from .fleet import Fleet

log = structlog.get_logger("vime.supervisor")

DEFAULT_CONFIG = "/etc/vime-supervisor/config.toml"


class Supervisor:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.fleet = Fleet(cfg)
        self._stop = asyncio.Event()

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
        # One session for every probe; no per-host connection cap (the fleet can be large).
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=4)
        async with aiohttp.ClientSession(connector=connector) as session:
            n = len(cfg.engines)
            for i, spec in enumerate(cfg.engines):
                # Spread probes over the interval instead of firing them all at once.
                runner = EngineRunner(spec, cfg, self.fleet, session, phase=cfg.probe.interval * i / n)
                self.fleet.runners[spec.name] = runner
            control = ControlServer(self.fleet, cfg.socket_path, allowed_uids=cfg.allowed_uids,
                                    socket_group=cfg.socket_group or None)
            await control.start()
            log.info("supervisor.started", pid=os.getpid(), socket=cfg.socket_path, engines=[s.name for s in cfg.engines],
                     fault_tolerance=cfg.use_fault_tolerance, interval=cfg.probe.interval,
                     timeout=cfg.probe.timeout, failure_threshold=cfg.probe.failure_threshold,
                     first_wait=cfg.probe.first_wait)
            for runner in self.fleet.runners.values():
                runner.start()
            try:
                await self._stop.wait()
                await self.shutdown()
            finally:
                await control.stop()

    async def shutdown(self) -> None:
        """Stop every engine in parallel, bounded: stop_timeout covers SIGTERM->SIGKILL."""
        runners = list(self.fleet.runners.values())
        log.info("supervisor.stopping", engines=len(runners))
        results = await asyncio.gather(*(r.shutdown() for r in runners), return_exceptions=True)
        for r, res in zip(runners, results):
            if isinstance(res, BaseException):
                log.error("supervisor.stop_failed", engine=r.name, error=repr(res))
        log.info("supervisor.stopped")


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
