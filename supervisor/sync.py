"""Bringing a STALE engine to the current weights, verified, in a round gap.

The tensors live in the trainer, so the daemon asks: a `sync_request` event goes to the
trainer agents on the event stream (trainer/resync_agent.py), and one of them pushes into that engine
alone over its own small process group, between `sync/begin` and `sync/end` calls. With no
agent connected, a checkpoint published with the version is the fallback: the daemon reloads
the engine from it. Either way the daemon then checks `/weight_info` and a deep probe before
the engine is RUNNING. A failed or timed-out sync leaves vLLM half-loaded (meta tensors
behind a 200 /health): the engine is poisoned and restarted, never routed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from .engine.runner import EngineRunner
from .errors import Conflict
from .events import Listener
from .fleet import Fleet, validate_checkpoint_off_loop
from .engine.fsm import vlabel
from .states import Transition
from .protocol import Event
from .states import ACTIVE, Cause, State
from .tasks import TaskSet

S = State
log = structlog.get_logger("vime.sync")

# An agent that takes a sync_request answers with sync/begin at once (the push itself is bounded
# by sync_timeout): one silent for this long is passed over for the checkpoint, if there is one.
AGENT_ANSWER_TIMEOUT = 60.0


def _why(e: BaseException, timeout: float) -> str:
    """A failure's reason, never empty (a TimeoutError's str() is "")."""
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not str(e):
        return f"not finished within sync_timeout ({timeout:g}s)"
    return str(e) or type(e).__name__


def _when(fleet: Fleet) -> str:
    """When membership may grow now, as a transition's reason says it."""
    if fleet.round is None:
        return "no round yet"
    if fleet.round_open:
        return f"admitted inside round {fleet.round}"
    return f"round {fleet.round} ended"


class SyncCoordinator(Listener):
    """Built by the daemon's start-up and added to the bus: it hears of STALE engines, round
    starts and ends and new versions, and drives engines through their runners' verbs."""

    def __init__(self, fleet: Fleet, sync_timeout: float = 300.0):
        self.fleet = fleet
        self.sync_timeout = sync_timeout
        self.agents = 0
        self._asked: dict[str, int] = {}  # engine -> version requested from the agents
        self._silent: dict[str, int] = {}  # engine -> version the agents never answered for
        self.agent_timeout = min(AGENT_ANSWER_TIMEOUT, sync_timeout)
        self._watchdogs: dict[str, asyncio.Task[None]] = {}  # engine -> its push's deadline (in _tasks)
        self._tasks = TaskSet("sync")

    # -- what the bus tells it -------------------------------------------------------------

    def on_transition(self, t: Transition) -> None:
        runner = self.fleet.runners.get(t.engine)
        if t.to_state is S.STALE and runner is not None:
            # After the transition has settled: consider() may annotate or start a reload.
            asyncio.get_running_loop().call_soon(self.consider, runner)
        elif (t.from_state in ACTIVE and t.to_state not in ACTIVE or t.from_state is S.STARTING
              or t.to_state is S.STANDBY):
            # One fewer engine serving, a start that ended (a re-adopted engine checked, or
            # not), or a spare that is back: in a gap, promote if the fleet is short.
            asyncio.get_running_loop().call_soon(self.promote_spares)

    def on_round_started(self, n: int) -> None:
        self.round_started()

    def on_round_ended(self, n: int) -> None:
        self.kick()

    def on_weights_published(self, version: int) -> None:
        self.kick()

    # -- when to sync ----------------------------------------------------------------------

    def agent_connected(self) -> None:
        self.agents += 1
        self._asked.clear()  # a new agent may not have seen earlier requests: ask again
        self._silent.clear()
        self.kick()

    def agent_disconnected(self) -> None:
        self.agents = max(0, self.agents - 1)
        self.kick()

    def round_started(self) -> None:
        self._asked.clear()  # requests refused during the round are asked again in the gap

    def kick(self) -> None:
        self.promote_spares()
        self.sync_spares()
        for runner in list(self.fleet.runners.values()):
            self.consider(runner)

    def promote_spares(self) -> None:
        """In a round gap, spares take the places of engines that failed: those already at the
        current version first (RUNNING at once), then the others (STALE: synced, verified).
        Inside a round with admit_mid_round, only those at the current version."""
        fleet = self.fleet
        version = fleet.current_version
        runners = [r for r in fleet.runners.values() if not r.retired]
        spares = sorted((r for r in runners if r.state is S.STANDBY),
                        key=lambda r: (r.weight_version != version, r.name))
        wanted = fleet.policy.spares_wanted(
            current_spares=sum(r.weight_version == version for r in spares),
            behind=0 if version is None else sum(r.booted_behind and r.weight_version != version for r in runners))
        if not wanted or any(r.readopting for r in fleet.runners.values()):
            return  # after a daemon restart, the re-adopted engines are checked first: they may serve
        gap = _when(fleet)
        for runner in spares[:wanted]:
            why = f"{fleet.policy.active}/{fleet.policy.target} engines active, {gap}"
            log.info("spare.promoted", engine=runner.name, active=fleet.policy.active, target=fleet.policy.target,
                     weight_version=runner.weight_version, version=version)
            runner.promote(why, version)

    def sync_spares(self) -> None:
        """With spares kept current (spares_sync = "publish"), in a gap: spares behind the
        current version (restarted inside a round, parked there) go STALE to be synced as
        serving engines are. After promote_spares: a current spare is promoted first."""
        fleet = self.fleet
        version = fleet.current_version
        if fleet.cfg.spares_sync != "publish" or fleet.round_open or version is None:
            return
        for runner in list(fleet.runners.values()):
            if runner.state is S.STANDBY and not runner.retired and runner.weight_version != version:
                runner.mark_outdated(version)

    def consider(self, runner: EngineRunner) -> None:
        """A STALE engine in a gap: release it if it already holds the current version,
        otherwise ask the agents for a push, or reload it from the checkpoint."""
        fleet = self.fleet
        version = fleet.current_version
        if runner.state is not S.STALE:
            return
        have = runner.weight_version
        spare = fleet.policy.park_reason() if version is not None and have != version else None
        if spare is not None and (fleet.cfg.spares_sync == "promotion" or fleet.round_open):
            # Not needed now: kept warm as it is, synced only if it is ever promoted; or, with
            # spares kept current, in the next gap (sync_spares). Inside a round too (a spare
            # restarted there): STANDBY is never routed, and left STALE it would count as an
            # active engine in the gap and keep a current spare from being promoted.
            when = "when promoted" if fleet.cfg.spares_sync == "promotion" else f"after round {fleet.round}"
            runner.park(f"weights {vlabel(have)}, current {vlabel(version)}: synced {when}; {spare}")
            return
        if fleet.round_open and not fleet.policy.admit_mid_round:
            if have != version:
                runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; sync after round {fleet.round}")
            return
        if version is None or have == version:
            runner.release(_when(fleet), version)
            return
        if fleet.round_open:
            # Admitted mid-round once verified at the round's version. A checkpoint reload is
            # exactly that version; the trainer agent's push waits for the gap, as the tensors
            # it would read may already be past the round's version in a pipelined loop.
            if fleet.checkpoint is None:
                runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; sync after round {fleet.round} "
                            "(no checkpoint published to reload from inside the round)")
                return
            runner.begin_sync(f"reloading {vlabel(version)} from checkpoint {fleet.checkpoint} inside round {fleet.round}")
            self._tasks.spawn(self._reload(runner, runner.incarnation, version, fleet.checkpoint))
            return
        if self.agents and self._silent.get(runner.name) != version:
            if self._asked.get(runner.name) == version:
                return
            self._asked[runner.name] = version
            runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; sync requested from the trainer agent")
            log.info("sync.requested", engine=runner.name, version=version)
            fleet.emit(Event.SYNC_REQUEST, engine=runner.name, url=runner.spec.base_url,
                       model=runner.spec.model_name, version=version)
            self._tasks.spawn(self._agent_deadline(runner, runner.incarnation, version))
        elif fleet.checkpoint is not None:
            # SYNCING now, synchronously: a second consider() must not start a second reload.
            runner.begin_sync(f"reloading {vlabel(version)} from checkpoint {fleet.checkpoint}")
            self._tasks.spawn(self._reload(runner, runner.incarnation, version, fleet.checkpoint))
        elif runner.dummy_weights:
            # Booted on dummy weights for a push that is not coming: never served, restarted
            # reading the model (slower, but real weights).
            why = (f"the trainer agent did not answer within {self.agent_timeout:g}s" if self.agents
                   else "the trainer agent went away")
            log.warning("sync.dummy_fallback", engine=runner.name, version=version, why=why)
            runner.restart_reading_the_model(f"dummy weights (restart_load = \"dummy\") and nothing to sync them: "
                                             f"{why} and no checkpoint was published; restarting reading the model")
        elif self.agents:
            runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; the trainer agent "
                        f"did not answer within {self.agent_timeout:g}s and no checkpoint was published "
                        "to reload from")
        else:
            runner.note(f"weights {vlabel(have)}, current {vlabel(version)}; waiting for a "
                        "trainer agent (no checkpoint published to reload from)")

    async def _agent_deadline(self, runner: EngineRunner, incarnation: int, version: int) -> None:
        """A connected agent that never calls sync/begin must not hold the engine STALE for
        ever: past agent_timeout it is passed over (the checkpoint, if any, is used)."""
        await asyncio.sleep(self.agent_timeout)
        if (runner.state is S.STALE and runner.incarnation == incarnation and self.fleet.current_version == version
                and self._asked.get(runner.name) == version):
            self._asked.pop(runner.name, None)
            self._silent[runner.name] = version
            log.warning("sync.agent_silent", engine=runner.name, version=version, timeout=self.agent_timeout)
            self.consider(runner)

    async def close(self) -> None:
        await self._tasks.aclose()
        self._watchdogs.clear()

    # -- the trainer agent's push ----------------------------------------------------------

    def begin(self, runner: EngineRunner, version: int) -> dict[str, Any]:
        fleet = self.fleet
        if version != fleet.current_version:
            raise Conflict(f"version {version} is not current ({vlabel(fleet.current_version)}); push the current version")
        if runner.state is not S.STALE:
            raise Conflict(f"{runner.name} is {runner.state.value}, not STALE: nothing to sync")
        if fleet.round_open:
            raise Conflict(f"round {fleet.round} is open; syncs run in the gap after it")
        runner.begin_sync(f"trainer agent pushing {vlabel(version)}")  # SYNCING is never probed
        self._asked.pop(runner.name, None)
        old = self._watchdogs.pop(runner.name, None)
        if old is not None:
            old.cancel()
        self._watchdogs[runner.name] = self._tasks.spawn(self._watchdog(runner, runner.incarnation, version),
                                                         name=f"sync-watchdog:{runner.name}")
        return {"engine": runner.name, "url": runner.spec.base_url, "version": version}

    async def end(self, runner: EngineRunner, version: int, ok: bool, error: str | None) -> dict[str, Any]:
        dog = self._watchdogs.pop(runner.name, None)
        if dog is not None:
            dog.cancel()
        if runner.state is not S.SYNCING:
            raise Conflict(f"{runner.name} is {runner.state.value}, not SYNCING: call sync/begin first")
        if not ok:
            self._poisoned(runner, f"push of {vlabel(version)} failed: {error or 'no detail'}")
        else:
            await self._verify(runner, runner.incarnation, version, "pushed by the trainer agent")
        return {"engine": runner.name, "state": runner.state.value, "reason": runner.reason}

    async def _watchdog(self, runner: EngineRunner, incarnation: int, version: int) -> None:
        await asyncio.sleep(self.sync_timeout)
        self._watchdogs.pop(runner.name, None)
        if runner.state is S.SYNCING and runner.incarnation == incarnation:
            self._poisoned(runner, f"push of {vlabel(version)} not finished within {self.sync_timeout:g}s")

    # -- the disk fallback -----------------------------------------------------------------

    async def _reload(self, runner: EngineRunner, incarnation: int, version: int, checkpoint: str) -> None:
        try:
            # Checked again (the files may have changed since publishing), off the loop, before
            # the engine is touched. Then the engine's work alone runs under sync_timeout: the
            # reload is async, so no engine waits for a thread with its clock running.
            await validate_checkpoint_off_loop(checkpoint)
            await asyncio.wait_for(runner.reload_weights(checkpoint, version, self.sync_timeout), self.sync_timeout)
        except Exception as e:  # any failure mid-reload leaves meta tensors behind
            if runner.state is S.SYNCING and runner.incarnation == incarnation:
                self._poisoned(runner, f"reload of {vlabel(version)} from {checkpoint} failed: "
                                       f"{_why(e, self.sync_timeout)}")
            return
        await self._verify(runner, incarnation, version, f"reloaded from {checkpoint}")

    # -- verification and poison -----------------------------------------------------------

    async def _verify(self, runner: EngineRunner, incarnation: int, version: int, how: str) -> None:
        ours, problem = await runner.verify_weights(version, incarnation)
        if not ours:  # the engine died or was stopped meanwhile
            return
        if problem is not None:
            self._poisoned(runner, f"{how}, but {problem}")
            return
        runner.finish_sync(version, hold=self.fleet.hold_reason())
        log.info("sync.verified", engine=runner.name, version=version, how=how)
        self.fleet.emit(Event.SYNC_VERIFIED, engine=runner.name, version=version, how=how)
        current = self.fleet.current_version
        if current is not None and version != current:  # a newer version was published meanwhile
            if runner.state is S.RUNNING:
                runner.mark_outdated(current)
            self.consider(runner)

    def _poisoned(self, runner: EngineRunner, why: str) -> None:
        log.warning("sync.poisoned", engine=runner.name, why=why)
        self.fleet.emit(Event.SYNC_FAILED, engine=runner.name, reason=why)
        # A spawned engine is stopped (post-mortem first) and restarted; an attached one stays
        # UNHEALTHY, probed, never routed, until it answers again on the current version.
        runner.condemn_and_stop(f"poisoned: {why}", Cause.SYNC_FAILED)
