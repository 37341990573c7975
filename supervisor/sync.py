"""Bringing a STALE engine to the current weights, verified, in a round gap.

The tensors live in the trainer, so the daemon asks: a `sync_request` event goes to the
trainer agents on the event stream (trainer/agent.py), and one of them pushes into that engine
alone over its own small process group, between `sync/begin` and `sync/end` calls. With no
agent connected, a checkpoint published with the version is the fallback: the daemon reloads
the engine from it. Either way the daemon then checks `/weight_info` and a deep probe before
the engine is RUNNING. A failed or timed-out sync leaves vLLM half-loaded (meta tensors
behind a 200 /health): the engine is poisoned and restarted, never routed.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog

from .errors import Conflict
from .fsm import vlabel
from .states import State

if TYPE_CHECKING:
    from .fleet import Fleet

S = State
log = structlog.get_logger("vime.sync")


class SyncCoordinator:
    def __init__(self, fleet: "Fleet", sync_timeout: float = 300.0):
        self.fleet = fleet
        self.sync_timeout = sync_timeout
        self.agents = 0
        self._asked: dict[str, int] = {}  # engine -> version requested from the agents
        self._watchdogs: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()

    # -- when to sync ----------------------------------------------------------------------

    def agent_connected(self) -> None:
        self.agents += 1
        self._asked.clear()  # a new agent may not have seen earlier requests: ask again
        self.kick()

    def agent_disconnected(self) -> None:
        self.agents = max(0, self.agents - 1)
        self.kick()

    def kick(self) -> None:
        for runner in list(self.fleet.runners.values()):
            self.consider(runner)

    def consider(self, runner: Any) -> None:
        """Ask for a sync if this engine is STALE on old weights and we are in a gap."""
        fleet, fsm = self.fleet, runner.fsm
        version = fleet.current_version
        if fsm.state is not S.STALE or version is None or fsm.weight_version == version:
            return
        if fleet.round_open:
            fsm.annotate(f"weights {vlabel(fsm.weight_version)}, current {vlabel(version)}; "
                         f"sync after round {fleet.round}")
            return
        if self.agents:
            if self._asked.get(runner.name) == version:
                return
            self._asked[runner.name] = version
            fsm.annotate(f"weights {vlabel(fsm.weight_version)}, current {vlabel(version)}; "
                         "sync requested from the trainer agent")
            log.info("sync.requested", engine=runner.name, version=version)
            fleet.emit("sync_request", engine=runner.name, url=runner.spec.base_url,
                       model=runner.spec.model_name, version=version)
        elif fleet.checkpoint is not None:
            self._spawn(self._reload(runner, version, fleet.checkpoint))
        else:
            fsm.annotate(f"weights {vlabel(fsm.weight_version)}, current {vlabel(version)}; waiting for a "
                         "trainer agent (no checkpoint published to reload from)")

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the trainer agent's push ----------------------------------------------------------

    def begin(self, runner: Any, version: int) -> dict[str, Any]:
        fleet, fsm = self.fleet, runner.fsm
        if version != fleet.current_version:
            raise Conflict(f"version {version} is not current ({vlabel(fleet.current_version)}); push the current version")
        if fsm.state is not S.STALE:
            raise Conflict(f"{runner.name} is {fsm.state.value}, not STALE: nothing to sync")
        if fleet.round_open:
            raise Conflict(f"round {fleet.round} is open; syncs run in the gap after it")
        runner.paused = True  # the agent pauses vLLM for the push: never probe it meanwhile
        fsm.sync_started(f"trainer agent pushing {vlabel(version)}")
        self._asked.pop(runner.name, None)
        self._watchdogs[runner.name] = asyncio.ensure_future(self._watchdog(runner, version))
        return {"engine": runner.name, "url": runner.spec.base_url, "version": version}

    async def end(self, runner: Any, version: int, ok: bool, error: str | None) -> dict[str, Any]:
        fsm = runner.fsm
        if fsm.state is not S.SYNCING:
            raise Conflict(f"{runner.name} is {fsm.state.value}, not SYNCING: call sync/begin first")
        dog = self._watchdogs.pop(runner.name, None)
        if dog is not None:
            dog.cancel()
        if not ok:
            self._poisoned(runner, f"push of {vlabel(version)} failed: {error or 'no detail'}")
        else:
            await self._verify(runner, version, "pushed by the trainer agent")
        return {"engine": runner.name, "state": fsm.state.value, "reason": fsm.reason}

    async def _watchdog(self, runner: Any, version: int) -> None:
        await asyncio.sleep(self.sync_timeout)
        if runner.fsm.state is S.SYNCING:
            self._watchdogs.pop(runner.name, None)
            self._poisoned(runner, f"push of {vlabel(version)} not finished within {self.sync_timeout:g}s")

    # -- the disk fallback -----------------------------------------------------------------

    async def _reload(self, runner: Any, version: int, checkpoint: str) -> None:
        from weight_sync.checkpoint import reload_from_checkpoint

        fsm = runner.fsm
        runner.paused = True
        fsm.sync_started(f"reloading {vlabel(version)} from checkpoint {checkpoint}")
        try:
            await asyncio.wait_for(
                asyncio.to_thread(reload_from_checkpoint, runner.spec.base_url, checkpoint, version),
                self.sync_timeout)
        except Exception as e:  # any failure mid-reload leaves meta tensors behind
            if fsm.state is S.SYNCING:
                self._poisoned(runner, f"reload of {vlabel(version)} from {checkpoint} failed: {e}")
            return
        await self._verify(runner, version, f"reloaded from {checkpoint}")

    # -- verification and poison -----------------------------------------------------------

    async def _verify(self, runner: Any, version: int, how: str) -> None:
        fsm = runner.fsm
        reported = await runner.prober.weight_version()
        if reported != version:
            self._poisoned(runner, f"{how}, but /weight_info says {vlabel(reported)}, not {vlabel(version)}")
            return
        probe = await runner.prober.generate()
        if not probe.ok:
            self._poisoned(runner, f"{how}, but the deep probe failed: {probe.detail}")
            return
        runner.paused = False
        if fsm.state is not S.SYNCING:
            return  # it died meanwhile; the runner has it
        fsm.sync_finished(version)
        log.info("sync.verified", engine=runner.name, version=version, how=how)
        self.fleet.emit("sync_verified", engine=runner.name, version=version, how=how)

    def _poisoned(self, runner: Any, why: str) -> None:
        log.warning("sync.poisoned", engine=runner.name, why=why)
        self.fleet.emit("sync_failed", engine=runner.name, reason=why)
        runner.paused = False
        runner.fsm.annotate(f"poisoned: {why}")
        runner.condemn()  # stopped and restarted: a half-loaded engine is never routed
