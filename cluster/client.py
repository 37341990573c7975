"""The trainer's client of a fleet on many nodes: one daemon per node, one node agent (a Ray
actor) per daemon, and this client over all of them, with the local client's shape.

    import ray
    from vime.cluster import AsyncClusterClient
    ray.init(address="auto")
    async with AsyncClusterClient(socket_path="/run/vime-supervisor/supervisor.sock") as sup:
        async with sup.round(412):                     # every node, concurrently
            view = await sup.routable_engines()        # engines named node/engine, one epoch
        await sup.publish_weights(413, "/ckpt/step-413")

What it decides is in view.py (pure); this module places the agents, fans calls out to them,
follows each node's events, and says what happened as events of its own (view.ClusterEvent).
Errors are the local client's classes (a node that cannot be reached: NodeUnavailable).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Mapping

from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential, wait_random

from vime.supervisor.client import VERBS
from vime.supervisor.client import errors as client_errors
from vime.supervisor.client.errors import ConflictError, DaemonUnreachable, SupervisorError
from vime.supervisor.protocol import Event, Role

from .agent import NodeAgent
from .routing import ATTEMPTS, LostNodeRemoval, lost_urls
from .view import (Change, ClusterEvent, ClusterPush, ClusterView, NodeState, by_node, floor_events, membership_event,
                   merge_push_end, merge_pushes, push_ids, qualify, qualify_answer, split, split_failed)

__all__ = ["AsyncClusterClient", "NodeUnavailable", "ClusterBelowFloor", "NODE_RESOURCE", "CLUSTER_VERBS",
           "NOT_CLUSTERED"]

# The control socket's verbs (the local client's table, VERBS) that the cluster does not offer,
# and why; every other verb of the table is a method of AsyncClusterClient with the local
# client's arguments (a test holds it to that), so a verb added to the table is offered here
# or named here.
NOT_CLUSTERED = {
    "signal": "a signal goes to one process on one node: use that node's SupervisorClient",
    "daemon_log": "each node's daemon has its own log: use that node's SupervisorClient",
}
CLUSTER_VERBS = tuple(v for v in VERBS if v not in NOT_CLUSTERED)

# The custom resource that marks the Ray nodes running a daemon, when `nodes` is not given:
#   ray start --address HEAD:6379 --resources '{"vime_supervisor": 1}'
NODE_RESOURCE = "vime_supervisor"
# A subscriber that falls this far behind gets an overflow event and its stream ends (as the
# daemon's own stream does): reconnecting gives a fresh hello.
MAX_QUEUED = 10_000
# Node events the client handles itself; a subscriber gets the cluster's own instead.
_NODE_ONLY = {Event.HELLO.value, Event.KEEPALIVE.value, Event.MEMBERSHIP.value, Event.RECONNECTED.value,
              Event.FLOOR_BREACH.value, Event.FLOOR_RESTORED.value, "agent_error"}


class NodeUnavailable(DaemonUnreachable):
    """The node's agent is dead or keeps being unavailable, or its daemon cannot be reached."""


class ClusterBelowFloor(ConflictError):
    """Fewer engines are routable across the nodes than min_healthy: the round does not start."""


def _whole(what: str, value: Any) -> int:
    """A round, version or count as the daemon takes it, checked before any node is asked."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise client_errors.BadRequest(f"{what} must be a whole number >= 0, got {value!r}", status=400,
                                       code="bad_argument")
    return value


def _rebuild(node: str, err: Mapping[str, Any]) -> SupervisorError:
    cls = getattr(client_errors, str(err.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, SupervisorError)):
        cls = SupervisorError
    code = err.get("code")
    if cls is DaemonUnreachable:  # the agent could not reach its daemon: the node is away
        cls, code = NodeUnavailable, "daemon_unreachable"
    return cls(f"node {node}: {err.get('message')}", status=err.get("status"), code=code)


def _unwrap(node: str, ans: Mapping[str, Any]) -> Any:
    """An agent's answer: its value, or the node's error raised as the local client's class."""
    if "error" in ans:
        raise _rebuild(node, ans["error"])
    return ans["ok"]


def _ray_errors() -> tuple[type[BaseException], type[BaseException]]:
    """(the agent is away for now, the agent is gone): ActorUnavailableError is the only one
    worth a retry; every other Ray error about the actor (it died, its node is gone so it
    cannot be scheduled, ...) means a new agent must be placed."""
    from ray.exceptions import ActorUnavailableError, RayError

    return ActorUnavailableError, RayError


class _Node:
    def __init__(self, name: str, node_id: str, agent: Any):
        self.name, self.node_id, self.agent = name, node_id, agent
        self.placed_at = time.monotonic()
        self.dead = False
        self.watcher: asyncio.Task | None = None


class AsyncClusterClient:
    """nodes: the Ray addresses of the nodes that run a daemon; default every alive Ray node
        with the `vime_supervisor` resource.
    socket_path: the daemons' socket: one path for every node, a mapping address -> path, or
        None (each node's default, $VIME_SUPERVISOR_SOCKET there or /run/vime-supervisor/...).
    min_healthy: the cluster floor, routable engines across nodes; a round does not start
        below it (ClusterBelowFloor) once it was first reached.
    call_timeout: how long one call to a node may take; past it the node is UNAVAILABLE (its
        engines out) until it answers again, and the others answer on.
    away_timeout: the one short try a call gives a node that is UNAVAILABLE.
    unavailable_grace: how long an agent that is unavailable (restarting, or its node going)
        is retried, with jittered backoff, before its node is lost; its engines are out of
        routing meanwhile.
    retry_for: how long one call retries an agent that is unavailable (only then, and only
        for calls that are safe to repeat; one that is not raises ConnectionLost).
    discover_interval: how often the Ray cluster is read for nodes that came (back).
    connect_timeout: the agents' connect timeout to their daemon (a dead daemon shows in this).
    ray_address: joins this Ray cluster ("auto", HEAD:PORT) when Ray is not initialised yet.
    admit_mid_round: a node that comes back inside a round is admitted at once (its engines at
        the cluster's version only), as the daemons' admit_mid_round does for engines.
    router_url: the router the nodes' daemons feed ([router] url): a node that is lost has its
        engines (its last routable answer) taken out of it here, since no daemon owns them
        then (cluster/routing.py); `router_kind` and `router_token` as the daemons' [router].
    """

    def __init__(self, nodes: list[str] | None = None, *, socket_path: str | Mapping[str, str] | None = None,
                 min_healthy: int = 1, call_timeout: float = 15.0, away_timeout: float = 2.0,
                 unavailable_grace: float = 10.0,
                 retry_for: float = 2.0, discover_interval: float = 2.0, connect_timeout: float = 2.0,
                 agent_max_restarts: int = 3, ray_address: str | None = None,
                 admit_mid_round: bool = False, router_url: str | None = None,
                 router_kind: str = "vllm-router", router_token: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.wanted = None if nodes is None else list(nodes)
        self.socket_path = socket_path
        self.call_timeout = call_timeout
        self.away_timeout = away_timeout
        self.unavailable_grace = unavailable_grace
        self.retry_for = retry_for
        self.discover_interval = discover_interval
        self.connect_timeout = connect_timeout
        self.agent_max_restarts = agent_max_restarts
        self.ray_address = ray_address
        self.view = ClusterView(min_healthy=min_healthy, admit_mid_round=admit_mid_round, clock=clock)
        self._nodes: dict[str, _Node] = {}
        self._subs: set[asyncio.Queue] = set()
        self._tasks: set[asyncio.Task] = set()
        self._placing: dict[str, float] = {}  # node -> earliest next placement (backoff)
        self._place_wait: dict[str, float] = {}
        self._gone_ids: set[str] = set()  # Ray nodes an agent could not be placed on: gone
        self._started = False
        self._connecting = False
        self._driver = False  # set by the first round or publish: this client drives the cluster
        self._shut = False
        self._publishing = 0
        self._overflowed: set[asyncio.Queue] = set()
        self.router = None if router_url is None else LostNodeRemoval(
            router_url, kind=router_kind, token=router_token, emit=self._emit)

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> "AsyncClusterClient":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def connect(self, timeout: float = 60.0) -> "AsyncClusterClient":
        """Place an agent on every node found, wait until each answered (or `timeout`), and
        start following them. Ray must be initialised (ray.init)."""
        import ray

        if not ray.is_initialized():
            if self.ray_address is None:
                raise RuntimeError("the cluster client runs in a Ray driver: call ray.init(address=...) "
                                   "first, or give ray_address (\"auto\" joins the node's Ray cluster)")
            ray.init(address=self.ray_address, log_to_driver=False)
        if self._started:
            return self
        self._started = True
        # Until every node has answered, nodes are only read, never brought to this client's
        # state (it has none yet): a trainer that connects mid-round must not end the round.
        self._connecting = True
        try:
            await self._discover()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(n not in self.view.nodes for n in self._nodes):
                await asyncio.sleep(0.05)
            await self._adopt()
        finally:
            self._connecting = False
        self._spawn(self._discover_loop())
        return self

    async def _adopt(self) -> None:
        """A new client (a trainer that restarted, a watcher) takes the cluster's round and
        weight version from its nodes, the newest of each, and changes nothing on them."""
        answers = {n: a for n, a in (await self._fanout("status")).items() if isinstance(a, dict)}
        if not answers:
            return
        view = self.view
        newest = max(answers.values(), key=lambda a: a["weight_version"] if isinstance(
            a.get("weight_version"), int) else -1)
        if isinstance(newest.get("weight_version"), int):
            view.published(newest["weight_version"], newest.get("checkpoint"))
        rounds = [a["round"] for a in answers.values() if isinstance(a.get("round"), int)]
        view.round = max(rounds) if rounds else None
        view.round_open = any(a.get("round_open") and a.get("round") == view.round for a in answers.values())
        self._change(view.recompute(), None, "adopted")

    async def aclose(self) -> None:
        """Stop following, end the event streams, and kill the agents (they hold nothing)."""
        import ray

        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._shut = True
        for q in list(self._subs):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)
        for node in self._nodes.values():
            with contextlib.suppress(Exception):
                ray.kill(node.agent, no_restart=True)
        self._nodes.clear()
        if self.router is not None:
            await self.router.aclose()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- what the trainer calls ------------------------------------------------------------

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Each node's state (UP, JOINING, UNAVAILABLE, LOST), why, and for how long."""
        return self.view.node_table()

    async def routable_engines(self) -> dict[str, Any]:
        """The union of the admitted nodes' routable engines, named node/engine, at the current
        weight version only; `epoch` moves whenever that set changes."""
        await self._read_nodes()
        return self.view.answer()

    async def _read_nodes(self, cause: str = "node_membership", version: tuple[int, str | None] | None = None) -> None:
        """Every live node's routable list, applied at once: the union (epoch, floor) is judged
        after all of them, never on half the answers."""
        answers = await self._fanout("routable_engines")
        changes: list[tuple[str, Change]] = []
        if version is not None:
            self.view.published(*version, settle=False)
        for node, ans in answers.items():
            if isinstance(ans, NodeUnavailable) and ans.code == "daemon_unreachable":
                self._lost(node, str(ans))
            elif not isinstance(ans, BaseException):
                changes.append((node, self.view.node_answered(node, ans, settle=False)))
        for node, change in changes:
            self._change(change, node, cause)
        self._change(self.view.recompute(), None, cause)

    async def status(self) -> dict[str, Any]:
        answers = await self._fanout("status")
        engines: list[dict[str, Any]] = []
        daemons: dict[str, Any] = {}
        for node, ans in answers.items():
            if isinstance(ans, BaseException):
                daemons[node] = {"error": str(ans)}
                continue
            engines += qualify_answer(node, ans)["engines"]
            daemons[node] = {k: ans.get(k) for k in ("daemon", "round", "round_open", "weight_version", "epoch",
                                                      "routable", "below_min_healthy")}
        table = self.view.node_table()
        for node, row in table.items():
            row["daemon"] = daemons.get(node)
        return {"epoch": self.view.epoch, "weight_version": self.view.weight_version, "round": self.view.round,
                "round_open": self.view.round_open, "routable": len(self.view.names()),
                "min_healthy": self.view.min_healthy, "below_min_healthy": self.view.below_floor,
                "nodes": table, "engines": engines}

    async def start_round(self, n: int) -> dict[str, Any]:
        """Start round n on every node, concurrently. A node that cannot be reached does not
        block it (its answer is an error in `nodes`). ClusterBelowFloor below the floor."""
        n = _whole("round", n)
        self._driver = True
        if self.view.below_floor and not (self.view.round_open and self.view.round == n):
            await self._read_nodes()  # judged on the nodes' lists as they are now
        if self.view.below_floor and not (self.view.round_open and self.view.round == n):
            raise ClusterBelowFloor(
                f"only {len(self.view.names())} engines are routable across the nodes, min_healthy is "
                f"{self.view.min_healthy}: round {n} does not start. Wait for nodes to return (nodes()) "
                f"or lower min_healthy", status=409, code="below_min_healthy")
        answers = await self._fanout("start_round", n)
        self._raise_if_all_refused(answers)
        self.view.round_started(n)
        return self._round_answer(n, True, answers)

    async def end_round(self, n: int) -> dict[str, Any]:
        """End round n on every node. The gap admits the nodes that came back meanwhile."""
        n = _whole("round", n)
        self._driver = True
        answers = await self._fanout("end_round", n)
        self._raise_if_all_refused(answers)
        for node in self.view.round_ended(n):
            self._emit({"event": ClusterEvent.NODE_ADMITTED.value, "node": node, "round": n})
        self._change(self.view.recompute(), None, "round_gap")
        return self._round_answer(n, False, answers)

    @contextlib.asynccontextmanager
    async def round(self, n: int) -> AsyncIterator[dict[str, Any]]:
        result = await self.start_round(n)
        try:
            yield result
        finally:
            await self.end_round(n)

    async def publish_weights(self, version: int, checkpoint: str | os.PathLike[str] | None = None,
                              fingerprint: dict[str, Any] | None = None) -> dict[str, Any]:
        """Make `version` current on every node; a node away now gets it when it returns.
        `fingerprint`: as the daemon's client takes it, sent to every node."""
        version = _whole("version", version)
        self._driver = True
        ckpt = None if checkpoint is None else os.path.abspath(os.fspath(checkpoint))
        self._publishing += 1  # nodes' membership events wait for the end of the publish
        try:
            answers = await self._fanout("publish_weights", version, ckpt, *(() if fingerprint is None else (fingerprint,)))
            self._raise_if_all_refused(answers)
            # The nodes' lists as they are now, with the new version: engines not at it leave
            # at once, those already at it stay (no empty union in between, no false breach).
            await self._read_nodes("weights_published", (int(version), ckpt))
        finally:
            self._publishing -= 1
        await self._unacknowledged_out(int(version), [n for n, a in answers.items() if isinstance(a, BaseException)])
        return {"version": int(version), "checkpoint": ckpt, "nodes": self._per_node(answers)}

    async def _unacknowledged_out(self, version: int, nodes: list[str]) -> None:
        """A node that did not take the publish judges by the version before: a shared router
        must not route to its engines the routing rule does not allow at `version` (sync mode:
        all but those at it). Their URLs (its last routable answer) are removed, waited for at most the removal's
        timeout (each outcome is a `router` event); its daemon, once it has the version, adds
        back those it verifies. A lost node's engines went already (_lost)."""
        if self.router is None or self._shut:
            return
        tasks = []
        for node in nodes:
            rec = self.view.nodes.get(node)
            if rec is None or rec.weight_version == version:
                continue  # it has the version already (an earlier publish it did take)
            urls = lost_urls(e for e in rec.routable if not self.view.rule.allows(e.get("weight_version"), version))
            if urls:
                tasks.append(self._spawn(self.router.remove(node, urls, f"it has not acknowledged version {version}")))
        if tasks:
            await asyncio.wait(tasks, timeout=self.router.timeout * ATTEMPTS)

    async def restart(self, name: str) -> dict[str, Any]:
        return await self._engine_call("restart", name, idempotent=False)

    async def stop(self, name: str) -> dict[str, Any]:
        return await self._engine_call("stop", name)

    async def start(self, name: str) -> dict[str, Any]:
        return await self._engine_call("start", name)

    async def retire(self, name: str) -> dict[str, Any]:
        return await self._engine_call("retire", name)

    async def report_failure(self, name: str, detail: str, *, poisoned: bool = False,
                             incarnation: int | None = None) -> dict[str, Any]:
        kw: dict[str, Any] = {"poisoned": poisoned}
        if incarnation is not None:
            kw["incarnation"] = incarnation
        return await self._engine_call("report_failure", name, detail, idempotent=False, **kw)

    async def sync_begin(self, name: str, version: int) -> dict[str, Any]:
        version = _whole("version", version)
        return await self._engine_call("sync_begin", name, version, idempotent=False)

    async def sync_end(self, name: str, version: int, ok: bool, error: str | None = None) -> dict[str, Any]:
        version = _whole("version", version)
        return await self._engine_call("sync_end", name, version, ok, error, idempotent=False)

    async def push_begin(self, version: int, engines: list[str], nbytes: int, deadline_s: float) -> ClusterPush:
        """Announce a push of `version` into `engines` (node/engine): each node's daemon is told
        its own receivers, with the same bytes and deadline, concurrently. Returns one id for
        push_end (a ClusterPush: a str, with `nodes` and `unannounced`). A node that does not
        take it (unavailable, lost, or it refused) does not stop it: the push goes on for the
        others, and that node's receivers are in `unannounced` with why; their daemon excuses
        their pause for sync_timeout only, not until the deadline. Raises as the local client
        does when no node took it. Not repeated after a dropped connection (check pushes())."""
        version, nbytes = _whole("version", version), _whole("nbytes", nbytes)
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
            raise client_errors.BadRequest(f"deadline_s must be a number of seconds > 0, got {deadline_s!r}",
                                           status=400, code="bad_argument")
        try:
            groups = by_node(engines)
        except ValueError as e:
            raise client_errors.BadRequest(str(e), status=400, code="bad_engine_name") from None
        if not groups:
            raise client_errors.BadRequest("engines must name at least one engine (the push's receivers)",
                                           status=400, code="bad_argument")
        answers = await self._each("push_begin", {n: (version, own, nbytes, float(deadline_s))
                                                  for n, own in groups.items()}, idempotent=False)
        self._raise_if_all_refused(answers)
        ids = {n: a for n, a in answers.items() if not isinstance(a, BaseException)}
        unannounced = {qualify(n, e): f"not announced to node {n}: {a}" for n, a in answers.items()
                       if isinstance(a, BaseException) for e in groups[n]}
        return ClusterPush(ids, unannounced)

    async def push_end(self, push: str, ok: bool, failed: Mapping[str, str] | None = None) -> dict[str, Any]:
        """End a cluster push on each of its nodes, concurrently, each with the `failed` names
        (node/engine: why) that are its own; the answers merged (view.merge_push_end), names
        qualified. Names on a node the push was not announced to are not sent (nothing to end
        there): `unannounced` in the answer. Raises as the local client does when no node
        ended it (unknown_push: ended already, or expired). Not repeated after a dropped
        connection (check pushes())."""
        try:
            ids = push_ids(push)
        except ValueError as e:
            raise SupervisorError(str(e), status=404, code="unknown_push") from None
        if ok and failed:  # as the daemon refuses it, before any node ends its part
            raise client_errors.BadRequest(f"ok is true but failed names {', '.join(sorted(failed))}; send ok=False",
                                           status=400, code="bad_argument")
        try:
            mine, elsewhere = split_failed(ids, failed or {})
        except ValueError as e:
            raise client_errors.BadRequest(str(e), status=400, code="bad_engine_name") from None
        answers = await self._each("push_end", {n: (own, bool(ok), mine[n] or None) for n, own in ids.items()},
                                   idempotent=False)
        self._raise_if_all_refused(answers)
        return {**merge_push_end(str(push), answers), "unannounced": elsewhere}

    async def pushes(self) -> list[dict[str, Any]]:
        """Every node's announced pushes in flight, each with `node`, its engines node/engine and
        its daemon's own push id (a cluster push's id names them: NODE=ID,...)."""
        return merge_pushes(await self._fanout("pushes"))

    async def engine_log(self, name: str, nbytes: int = 16384) -> str:
        nbytes = _whole("nbytes", nbytes)
        return await self._engine_call("engine_log", name, nbytes)

    async def incidents(self) -> list[dict[str, Any]]:
        answers = await self._fanout("incidents")
        return [dict(qualify_answer(node, i), node=node) for node, ans in sorted(answers.items())
                if not isinstance(ans, BaseException) for i in ans]

    async def metrics(self) -> dict[str, str]:
        """Each node's Prometheus text, by node."""
        return {node: ans for node, ans in (await self._fanout("metrics")).items() if isinstance(ans, str)}

    async def events(self, *, role: Role | str = Role.OBSERVER, keepalives: bool = False
                     ) -> AsyncGenerator[dict[str, Any], None]:
        """One stream of every node's events (each with `node`, engine names node/engine) and the
        cluster's own: a hello first, membership with the cluster epoch, node_joined,
        node_admitted, node_unavailable, node_lost, floor_breach/floor_restored (scope cluster).
        `role` is opened on every node (Role.AGENT for a sync agent)."""
        q: asyncio.Queue = asyncio.Queue(MAX_QUEUED)
        self._subs.add(q)
        relays: dict[str, asyncio.Task] = {}

        def relay(node: str) -> None:
            task = relays.get(node)
            rec = self._nodes.get(node)
            if rec is not None and not rec.dead and (task is None or task.done()):
                relays[node] = self._spawn(self._relay(rec, str(role), q))

        try:
            yield {"event": Event.HELLO.value, "ts": time.time(), "node": None, "scope": "cluster", **self.view.answer(),
                   "routable": self.view.names(), "round": self.view.round, "round_open": self.view.round_open}
            for node in self.view.live():
                relay(node)
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), 10.0)
                except asyncio.TimeoutError:
                    if keepalives:
                        yield {"event": Event.KEEPALIVE.value, "ts": time.time(), "node": None}
                    continue
                if ev is None:
                    return
                if q in self._overflowed:
                    yield {"event": Event.OVERFLOW.value, "ts": time.time(), "node": None,
                           "message": f"more than {MAX_QUEUED} events unread: this stream ends; open another"}
                    return
                if ev.get("event") == ClusterEvent.NODE_JOINED:
                    relay(ev["node"])
                yield ev
        finally:
            self._subs.discard(q)
            self._overflowed.discard(q)
            for t in relays.values():
                t.cancel()

    # -- calls -----------------------------------------------------------------------------

    async def _call(self, node: str, verb: str, *args: Any, idempotent: bool = True, **kwargs: Any) -> Any:
        unavailable, gone = _ray_errors()
        from ray.exceptions import RayTaskError as task_failed

        rec = self._nodes.get(node)
        if node not in self.view.nodes and rec is None:
            raise client_errors.UnknownEngine(f"no node {node!r} in the cluster (nodes: {sorted(self.view.nodes)})",
                                              status=404, code="unknown_node")
        if rec is None or rec.dead or self.view.nodes.get(node) and self.view.nodes[node].state is NodeState.LOST:
            why = self.view.nodes[node].reason if node in self.view.nodes else "no agent"
            raise NodeUnavailable(f"node {node} is lost ({why}): its engines are out of routing until it returns",
                                  code="node_unavailable")

        away = self._state_of(node) is NodeState.UNAVAILABLE
        # A node known to be away gets one short try: a round must not wait on it.
        limit = min(self.call_timeout, self.away_timeout) if away else self.call_timeout

        async def once() -> Any:
            return await asyncio.wait_for(rec.agent.call.remote(verb, args, kwargs), limit)

        retry = idempotent and not away
        try:
            if retry:
                ans: Any = None
                async for attempt in AsyncRetrying(
                        stop=stop_after_delay(self.retry_for),
                        wait=wait_exponential(multiplier=0.1, max=2.0) + wait_random(0, 0.2),
                        # judged at each failure: once the watcher has marked the node away,
                        # this call stops waiting for it
                        retry=retry_if_exception(lambda e: isinstance(e, unavailable) and (
                            self._state_of(node) is not NodeState.UNAVAILABLE)), reraise=True):
                    with attempt:
                        ans = await once()
            else:
                ans = await once()
        except unavailable as e:
            if not idempotent:
                raise client_errors.ConnectionLost(
                    f"node {node}'s agent became unavailable during {verb} ({e}); it may or may not have "
                    f"taken effect: check status() before repeating it", code="connection_lost") from None
            reason = f"agent unavailable during {verb}: {str(e).splitlines()[0][:200]}"
            if self._nodes.get(node) is rec:  # not a replaced agent's late failure
                self._change(self.view.node_unavailable(node, reason), node, "node_unavailable", reason)
            raise NodeUnavailable(f"node {node}: its agent is unavailable ({e})", code="node_unavailable") from None
        except task_failed as e:  # the agent's method raised: a bug of ours, not a lost node
            raise SupervisorError(f"node {node}: the agent failed on {verb}: {str(e).splitlines()[-1][:300]}",
                                  code="agent_error") from None
        except gone as e:
            if self._nodes.get(node) is rec:
                self._agent_lost(rec, f"agent gone ({type(e).__name__})", e)
            else:
                rec.dead = True
            raise NodeUnavailable(f"node {node}: its agent is gone ({type(e).__name__})", code="node_unavailable") from None
        except asyncio.TimeoutError:
            # A daemon that does not answer (hung, stopped) cannot vouch for its engines: out
            # at once; fan-outs skip it and its watcher says when it answers again.
            reason = f"did not answer {verb} within {limit:g}s"
            if self._nodes.get(node) is rec:
                self._change(self.view.node_unavailable(node, reason), node, "node_unavailable", reason)
            raise NodeUnavailable(f"node {node} {reason}", code="timeout") from None
        return _unwrap(node, ans)

    async def _fanout(self, verb: str, *args: Any) -> dict[str, Any]:
        """The verb on every live node at once: node -> answer, or the SupervisorError it raised."""
        return await self._each(verb, {n: args for n in self.view.live() or sorted(self._nodes)})

    async def _each(self, verb: str, args_of: Mapping[str, tuple], *, idempotent: bool = True) -> dict[str, Any]:
        """The verb on each named node at once, with that node's arguments: node -> answer, or
        the SupervisorError it raised."""
        nodes = sorted(args_of)

        async def one(n: str) -> Any:
            rec = self.view.nodes.get(n)
            if rec is not None and rec.state is NodeState.UNAVAILABLE:
                # Not waited on: its watcher retries it in the background and brings it back.
                raise NodeUnavailable(f"node {n} is unavailable ({rec.reason}); retried in the background",
                                      code="node_unavailable")
            return await self._call(n, verb, *args_of[n], idempotent=idempotent)

        results = await asyncio.gather(*(one(n) for n in nodes), return_exceptions=True)
        out: dict[str, Any] = {}
        for node, res in zip(nodes, results):
            if isinstance(res, BaseException) and not isinstance(res, SupervisorError):
                raise res
            out[node] = res
        return out

    async def _engine_call(self, verb: str, name: str, *args: Any, idempotent: bool = True, **kw: Any) -> Any:
        try:
            node, engine = split(name)
        except ValueError as e:
            raise client_errors.BadRequest(str(e), status=400, code="bad_engine_name") from None
        return qualify_answer(node, await self._call(node, verb, engine, *args, idempotent=idempotent, **kw))

    @staticmethod
    def _per_node(answers: Mapping[str, Any]) -> dict[str, Any]:
        return {n: ({"error": str(a), "code": getattr(a, "code", None)} if isinstance(a, BaseException) else a)
                for n, a in answers.items()}

    def _round_answer(self, n: int, is_open: bool, answers: Mapping[str, Any]) -> dict[str, Any]:
        changed = any(isinstance(a, dict) and a.get("changed") for a in answers.values())
        return {"round": n, "open": is_open, "changed": changed, "nodes": self._per_node(answers)}

    @staticmethod
    def _raise_if_all_refused(answers: Mapping[str, Any]) -> None:
        """Unless some node took the request: a refusal (a stale round, a bad checkpoint) is
        the caller's mistake and raised as the local client would; no node reached at all is
        NodeUnavailable. Either way the cluster's own state is not changed."""
        if any(not isinstance(a, BaseException) for a in answers.values()):
            return
        refusals = [a for a in answers.values() if not isinstance(a, DaemonUnreachable)]
        if refusals:
            raise refusals[0]
        why = "; ".join(f"{n}: {a}" for n, a in sorted(answers.items())) or "no node in the cluster"
        raise NodeUnavailable(f"no node could be reached ({why})", code="node_unavailable")

    # -- following the nodes ---------------------------------------------------------------

    def _emit(self, ev: dict[str, Any]) -> None:
        ev.setdefault("ts", time.time())
        for q in list(self._subs):
            self._put(q, ev)

    def _put(self, q: asyncio.Queue, ev: dict[str, Any]) -> None:
        if q in self._overflowed:
            return
        try:
            q.put_nowait(ev)
        except asyncio.QueueFull:
            self._overflowed.add(q)

    def _change(self, change: Change, node: str | None, cause: str, reason: str | None = None) -> None:
        """Say what an update of the view did, as events: the node's new state, the cluster's
        membership (a new epoch), the floor."""
        if change.entered is not None and node is not None:
            entered, left = change.entered, change.left
            if entered is NodeState.JOINING or (entered is NodeState.UP and left is not NodeState.JOINING):
                self._emit({"event": ClusterEvent.NODE_JOINED.value, "node": node})
            if entered is NodeState.UP:
                self._emit({"event": ClusterEvent.NODE_ADMITTED.value, "node": node, "round": self.view.round})
            elif entered is NodeState.UNAVAILABLE:
                self._emit({"event": ClusterEvent.NODE_UNAVAILABLE.value, "node": node, "reason": reason})
            elif entered is NodeState.LOST:
                self._emit({"event": ClusterEvent.NODE_LOST.value, "node": node, "reason": reason})
        if change.epoch_moved:
            self._emit(membership_event(self.view, node, cause))
        for ev in floor_events(self.view, change):
            self._emit(ev)

    def _lost(self, node: str, reason: str) -> None:
        rec = self.view.nodes.get(node)
        urls = [] if rec is None or rec.state is NodeState.LOST else lost_urls(rec.routable)
        self._change(self.view.node_lost(node, reason), node, ClusterEvent.NODE_LOST, reason)
        if self.router is not None and urls and not self._shut:
            self._spawn(self.router.remove(node, urls))  # never awaited by the watchers

    def _agent_lost(self, rec: _Node, reason: str, error: BaseException | None = None) -> None:
        rec.dead = True
        if type(error).__name__ == "ActorUnschedulableError":
            self._gone_ids.add(rec.node_id)  # its node is gone, whatever Ray still lists
        self._lost(rec.name, reason)

    async def _relay(self, rec: _Node, role: str, q: asyncio.Queue) -> None:
        """One subscriber's stream from one node: the node's events, names made cluster names."""
        gen = rec.agent.events.options(num_returns="streaming").remote(role)
        try:
            async for ref in gen:
                ev = await ref
                if ev.get("event") in _NODE_ONLY:
                    continue
                self._put(q, {**qualify_answer(rec.name, ev), "node": rec.name})
        except asyncio.CancelledError:
            raise
        except Exception:
            return  # the watcher says what happened to the node; a rejoin opens a new relay
        finally:
            _cancel(gen)

    async def _watch(self, rec: _Node) -> None:
        """Follow one node through its agent: its hello and membership changes update the view;
        an unreachable daemon or a dead agent loses the node at once; an unavailable agent takes
        its engines out at once and is retried, jittered, for unavailable_grace."""
        unavailable, gone = _ray_errors()
        away_since: float | None = None
        while not rec.dead:
            gen = rec.agent.events.options(num_returns="streaming").remote(Role.OBSERVER.value)
            try:
                async for ref in gen:
                    ev = await ref
                    away_since = None
                    kind = ev.get("event")
                    if kind == "agent_error":
                        self._lost(rec.name, f"daemon unreachable: {ev['error'].get('message')}")
                        break
                    if kind == Event.HELLO or self._state_of(rec.name) in (NodeState.LOST, NodeState.UNAVAILABLE):
                        await self._joined(rec)
                    elif kind == Event.MEMBERSHIP:
                        await self._refresh(rec)
            except asyncio.CancelledError:
                _cancel(gen)
                raise
            except unavailable as e:
                now = time.monotonic()
                away_since = away_since or now
                if now - away_since >= self.unavailable_grace:
                    self._agent_lost(rec, f"agent unavailable for {self.unavailable_grace:g}s")
                    return
                reason = f"agent unavailable: {str(e).splitlines()[0][:200]}"
                self._change(self.view.node_unavailable(rec.name, reason), rec.name, "node_unavailable", reason)
            except gone as e:
                self._agent_lost(rec, f"agent gone ({type(e).__name__})", e)
                return
            except Exception as e:  # an answer we did not expect: the node is not trusted now
                self._lost(rec.name, f"{type(e).__name__}: {e}")
            _cancel(gen)
            await asyncio.sleep(min(1.0, self.discover_interval) * (0.5 + random.random()))

    def _state_of(self, node: str) -> NodeState | None:
        r = self.view.nodes.get(node)
        return None if r is None else r.state

    async def _refresh(self, rec: _Node) -> None:
        try:
            ans = await self._call_direct(rec, "routable_engines")
        except SupervisorError:
            return  # the stream says what happens to the node next
        # During a publish a node may list the new version before the cluster has it: its
        # list is kept, and judged with the others when the publish ends.
        self._change(self.view.node_answered(rec.name, ans, settle=not self._publishing), rec.name, "node_membership")

    async def _joined(self, rec: _Node) -> None:
        """A node's daemon answers (first time, or back): bring it to the cluster's round and
        weight version, then let the view admit it (now in a gap, else at the next gap)."""
        try:
            if not self._connecting:
                # Also for a node that stayed UP: its daemon restarted (this is its hello) and
                # may have come back without its journal.
                await self._reconcile(rec)
            ans = await self._call_direct(rec, "routable_engines")
        except SupervisorError as e:
            self._lost(rec.name, f"could not be brought to the cluster's round and version: {e}")
            return
        self._change(self.view.node_answered(rec.name, ans), rec.name, "node_joined")

    async def _call_direct(self, rec: _Node, verb: str, *args: Any) -> Any:
        """A call to a node that the view does not count as live yet (joining)."""
        try:
            ans = await asyncio.wait_for(rec.agent.call.remote(verb, args, {}), self.call_timeout)
        except asyncio.TimeoutError:
            raise NodeUnavailable(f"node {rec.name} did not answer {verb} within {self.call_timeout:g}s") from None
        except Exception as e:
            raise NodeUnavailable(f"node {rec.name}: {type(e).__name__}: {e}") from None
        return _unwrap(rec.name, ans)

    async def _reconcile(self, rec: _Node) -> None:
        """Bring a node that (re)joins to the cluster's round and version. Only a client that
        drives the cluster (it has started or ended a round, or published) writes: a client
        that only watches must never end the trainer's round on a node, nor publish to it."""
        if not self._driver:
            return
        st = await self._call_direct(rec, "status")
        view = self.view
        with contextlib.suppress(ConflictError):  # the node moved on meanwhile: it says so itself
            if st.get("round_open") and not (view.round_open and st.get("round") == view.round):
                await self._call_direct(rec, "end_round", st["round"])  # a round the cluster has ended
            if view.round_open and view.round is not None and not (
                    st.get("round_open") and st.get("round") == view.round):
                await self._call_direct(rec, "start_round", view.round)
        # Only a version this client published (or adopted with its checkpoint) is published
        # again: one learned from a node's answer is the publisher's to hand out.
        if view.weight_version is not None and not view.version_learned and (
                st.get("weight_version") is None or st["weight_version"] < view.weight_version):
            with contextlib.suppress(ConflictError):
                await self._call_direct(rec, "publish_weights", view.weight_version, view.checkpoint)

    # -- placing agents --------------------------------------------------------------------

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discover_interval)
            try:
                await self._discover()
            except Exception:  # the GCS is away for a moment: the next look tries again
                continue

    async def _discover(self) -> None:
        import ray

        found: dict[str, list[str]] = {}  # address -> alive node ids (Ray may list a lost node for a while)
        for info in await asyncio.to_thread(ray.nodes):
            name = info.get("NodeManagerAddress")
            if not info.get("Alive") or (self.wanted is not None and name not in self.wanted):
                continue
            if self.wanted is None and NODE_RESOURCE not in (info.get("Resources") or {}):
                continue
            if info["NodeID"] not in self._gone_ids:
                found.setdefault(name, []).append(info["NodeID"])
        for name, ids in found.items():
            rec = self._nodes.get(name)
            if rec is not None and not rec.dead and rec.node_id in ids:
                continue  # its agent is where it should be
            if time.monotonic() < self._placing.get(name, 0.0) and rec is not None and rec.node_id == ids[-1]:
                continue  # backoff: its last agent on this Ray node died soon after being placed
            if rec is not None:
                if rec.watcher is not None:
                    rec.watcher.cancel()
                if not rec.dead:  # a new Ray node at that address: the old one, and its agent, are gone
                    rec.dead = True
                    self._gone_ids.add(rec.node_id)
                    if self._state_of(name) is NodeState.UP:
                        self._lost(name, "replaced by a new Ray node at the same address")
                with contextlib.suppress(Exception):  # whatever is left of the old agent
                    ray.kill(rec.agent, no_restart=True)
                quick = time.monotonic() - rec.placed_at < 60.0
                wait = min(60.0, self._place_wait.get(name, self.discover_interval) * 2) if quick else self.discover_interval
                self._place_wait[name] = wait
                self._placing[name] = time.monotonic() + wait
            self._place(name, ids[-1])

    def _socket_for(self, node: str) -> str | None:
        if isinstance(self.socket_path, Mapping):
            return self.socket_path.get(node)
        return None if self.socket_path is None else os.fspath(self.socket_path)

    def _place(self, name: str, node_id: str) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        agent = ray.remote(NodeAgent).options(
            num_cpus=0, max_restarts=self.agent_max_restarts, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(self._socket_for(name), connect_timeout=self.connect_timeout, timeout=self.call_timeout)
        rec = self._nodes[name] = _Node(name, node_id, agent)
        rec.watcher = self._spawn(self._watch(rec))


def _cancel(gen: Any) -> None:
    try:
        import ray

        ray.cancel(gen)
    except Exception:
        pass
