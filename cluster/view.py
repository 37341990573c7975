"""The cluster's view of its nodes, as pure decisions (no Ray, no I/O; the clock is injected).

`ClusterView` holds what the cluster client learned from each node's daemon (its routable list,
its epoch, whether it can be reached) and decides what the trainer sees:

- engines are named `node/engine` (the node is its Ray address, e.g. 10.0.0.7);
- the routable list is the union of the admitted nodes' lists, never an engine whose
  weight_version the routing rule does not allow at the cluster's current version
  (states.VersionRule, the daemons' one rule: the mode and bound each node's daemon answers
  with, the strictest of them when nodes differ);
- one cluster epoch, a counter that moves whenever that union changes (a node lost, a node
  admitted, any node's own membership change);
- a node whose agent does not answer is UNAVAILABLE and its engines leave the union at once
  (nobody can vouch for them); it is retried, and LOST after a grace (or at once when its
  agent or its daemon is known dead);
- a node that comes back (or is seen for the first time after the start) is JOINING: its
  engines join routing only in a round gap (`round_ended`, or at once when no round is open),
  or at once with `admit_mid_round` (only its engines at the cluster's version are routable,
  as for every node; a node whose daemon missed a publish lists none until it catches up);
- the floor: `min_healthy` routable engines across nodes, armed once first reached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterable, Mapping

from vime.supervisor.protocol import Event
from vime.supervisor.states import VersionRule

SEP = "/"


class NodeState(StrEnum):
    UP = "UP"  # reachable, its engines in the union
    JOINING = "JOINING"  # reachable again (or new): its engines wait for a round gap
    UNAVAILABLE = "UNAVAILABLE"  # its agent does not answer now: retried for a grace, engines out
    LOST = "LOST"  # agent or node dead, or its daemon unreachable: engines out


class ClusterEvent(StrEnum):
    """Events the cluster client makes itself (every other event is a node's, with `node`)."""

    NODE_JOINED = "node_joined"  # an agent reached the node's daemon; its engines wait for a gap
    NODE_ADMITTED = "node_admitted"  # a gap came: the node's engines are in the union
    NODE_UNAVAILABLE = "node_unavailable"  # its agent is unavailable for a moment: retrying
    NODE_LOST = "node_lost"  # its engines left the union at once


def qualify(node: str, engine: str) -> str:
    return f"{node}{SEP}{engine}"


def split(name: str) -> tuple[str, str]:
    """'node/engine' -> (node, engine). Node names are addresses, engine names carry no '/'
    (the daemon refuses them), so the last '/' splits."""
    node, sep, engine = str(name).rpartition(SEP)
    if not sep or not node or not engine:
        raise ValueError(f"{name!r} is not a cluster engine name: use NODE/ENGINE as the cluster's "
                         f"routable list and status name them (e.g. 10.0.0.7/engine0)")
    return node, engine


def qualify_answer(node: str, obj: Any) -> Any:
    """A node's answer or event with its engine names made cluster names: the `engine` field,
    `name` in each entry of an `engines` list (or the names of a push's `engines` list), the
    keys of a push's `failed` and `condemned`, `routable` name lists."""
    if isinstance(obj, list):
        return [qualify_answer(node, x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    out = dict(obj)
    if isinstance(out.get("engine"), str):
        out["engine"] = qualify(node, out["engine"])
    if isinstance(out.get("engines"), list):
        out["engines"] = [{**e, "name": qualify(node, e["name"]), "node": node}
                          if isinstance(e, dict) and isinstance(e.get("name"), str)
                          else qualify(node, e) if isinstance(e, str) else e
                          for e in out["engines"]]
    for key in ("failed", "condemned"):  # a push's receivers -> why
        if isinstance(out.get(key), dict):
            out[key] = {qualify(node, k): v for k, v in out[key].items()}
    if isinstance(out.get("routable"), list):
        out["routable"] = [qualify(node, n) if isinstance(n, str) else n for n in out["routable"]]
    return out


# -- announced pushes across nodes ------------------------------------------------------------

PUSH_SEP, PUSH_NODE = ",", "="


def by_node(names: Iterable[str]) -> dict[str, list[str]]:
    """Cluster engine names by node: node -> its engines' own names, in the order given.
    ValueError for a name that is not node/engine, or one given twice."""
    out: dict[str, list[str]] = {}
    for name in names:
        node, engine = split(name)
        mine = out.setdefault(node, [])
        if engine in mine:
            raise ValueError(f"{name} is named more than once: name each receiver once")
        mine.append(engine)
    return out


def push_id(ids: Mapping[str, str]) -> str:
    """One cluster push's id from each node's own: NODE=ID,NODE=ID (by node). Node addresses
    and the daemons' ids (HEX-N) carry neither ',' nor '=', so the id alone says where to end
    the push: any client can end it (a trainer restarted), nothing is kept in this one."""
    if not ids:
        raise ValueError("a cluster push has at least one node's push")
    return PUSH_SEP.join(f"{n}{PUSH_NODE}{ids[n]}" for n in sorted(ids))


def push_ids(push: str) -> dict[str, str]:
    """node -> its daemon's push id; ValueError for a string that is not a cluster push's id."""
    out: dict[str, str] = {}
    for part in str(push).split(PUSH_SEP):
        node, sep, own = part.partition(PUSH_NODE)
        if not sep or not node or not own or node in out:
            raise ValueError(f"{str(push)[:80]!r} is not a cluster push id (NODE=ID,NODE=ID as the cluster "
                             f"client's push_begin returns it)")
        out[node] = own
    return out


class ClusterPush(str):
    """The cluster's push_begin answer: the push's id (a str, for push_end, as the local client
    returns one), with `nodes` (node -> its daemon's push id) and `unannounced` (node/engine ->
    why: receivers on a node that did not take the announcement; its daemon excuses their
    pauses for sync_timeout only)."""

    nodes: dict[str, str]
    unannounced: dict[str, str]

    def __new__(cls, nodes: Mapping[str, str], unannounced: Mapping[str, str] | None = None) -> "ClusterPush":
        self = super().__new__(cls, push_id(nodes))
        self.nodes = dict(nodes)
        self.unannounced = dict(unannounced or {})
        return self


def split_failed(nodes: Iterable[str], failed: Mapping[str, str]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """The receivers the trainer reports failed, for push_end: (node -> {engine: why} for each
    of the push's nodes, {node/engine: why} for those on a node the push was not announced to:
    there is nothing to end there). ValueError for a name that is not node/engine."""
    mine: dict[str, dict[str, str]] = {n: {} for n in nodes}
    elsewhere: dict[str, str] = {}
    for name, why in failed.items():
        node, engine = split(name)
        if node in mine:
            mine[node][engine] = str(why)
        else:
            elsewhere[name] = str(why)
    return mine, elsewhere


def merge_push_end(push: str, answers: Mapping[str, Any]) -> dict[str, Any]:
    """The nodes' push_end answers (or the error each raised) as one, names qualified:
    outcome ok only if every node that ended it says ok; seconds the longest; late if any was;
    engines, failed and condemned of every node; `nodes` each node's own answer (or its
    error); `not_ended` node -> why, for the nodes that did not end it (their daemon expires
    it by itself past its deadline)."""
    ended = {n: qualify_answer(n, a) for n, a in sorted(answers.items()) if isinstance(a, Mapping)}
    not_ended = {n: str(a) for n, a in sorted(answers.items()) if not isinstance(a, Mapping)}
    return {
        "push": str(push),
        "version": next((a.get("version") for a in ended.values()), None),
        "outcome": "ok" if ended and all(a.get("outcome") == "ok" for a in ended.values()) else "failed",
        "seconds": max((float(a.get("seconds") or 0.0) for a in ended.values()), default=0.0),
        "late": any(bool(a.get("late")) for a in ended.values()),
        "engines": [e for a in ended.values() for e in a.get("engines") or ()],
        "failed": {k: v for a in ended.values() for k, v in (a.get("failed") or {}).items()},
        "condemned": {k: v for a in ended.values() for k, v in (a.get("condemned") or {}).items()},
        "nodes": {n: ended.get(n) or {"error": not_ended[n], "code": getattr(answers[n], "code", None)}
                  for n in sorted(answers)},
        "not_ended": not_ended,
    }


def merge_pushes(answers: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The nodes' lists of pushes in flight as one: each entry the node's own (its daemon's
    push id), with `node` and its engines qualified. A node that did not answer lists none."""
    return [{**qualify_answer(n, p), "node": n} for n, a in sorted(answers.items()) if isinstance(a, list)
            for p in a if isinstance(p, Mapping)]


@dataclass
class NodeRecord:
    name: str
    state: NodeState
    since: float
    reason: str = ""
    routable: list[dict[str, Any]] = field(default_factory=list)  # the node's own routable entries
    node_epoch: int | None = None
    weight_version: int | None = None  # the node daemon's current version
    rule: VersionRule | None = None  # the routing rule its daemon answered with (None: no answer yet)
    lost_count: int = 0


@dataclass(frozen=True)
class Change:
    """What one update did: the node's new state (None: unchanged), the epoch moved, the
    floor was breached or restored."""

    entered: NodeState | None = None
    left: NodeState | None = None
    epoch_moved: bool = False
    breached: bool = False
    restored: bool = False


class ClusterView:
    def __init__(self, *, min_healthy: int = 1, admit_mid_round: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.min_healthy = min_healthy
        self.admit_mid_round = admit_mid_round
        self.clock = clock
        self.nodes: dict[str, NodeRecord] = {}
        self.epoch = 0
        self.weight_version: int | None = None
        self.checkpoint: str | None = None
        self.version_learned = False  # the version came from a node's answer, not a publish
        self.round: int | None = None  # the last round started
        self.round_open = False
        self.below_floor = False
        self.floor_breaches = 0
        self._floor_armed = False
        self._last_set: frozenset[tuple[str, str | None, Any]] = frozenset()

    # -- what the trainer sees ------------------------------------------------------------

    @property
    def rule(self) -> VersionRule:
        """The routing rule the cluster applies: the nodes' daemons' (the strictest when they
        differ; sync before any has answered)."""
        return VersionRule.strictest([r.rule for r in self.nodes.values() if r.rule is not None])

    def routable(self) -> list[dict[str, Any]]:
        out = []
        rule = self.rule
        for rec in sorted(self.nodes.values(), key=lambda r: r.name):
            if rec.state is not NodeState.UP:
                continue
            for e in rec.routable:
                if not rule.allows(e.get("weight_version"), self.weight_version):
                    continue  # never an engine the rule does not allow, whatever a node said
                out.append({**e, "name": qualify(rec.name, e["name"]), "node": rec.name})
        return out

    def answer(self) -> dict[str, Any]:
        """The cluster's routable answer (the shape of a daemon's, plus `nodes`)."""
        return {"epoch": self.epoch, "weight_version": self.weight_version, "weights": self.rule.as_dict(),
                "engines": self.routable(),
                "nodes": {n: r.state.value for n, r in sorted(self.nodes.items())}}

    def names(self) -> list[str]:
        return [e["name"] for e in self.routable()]

    def node_table(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        return {n: {"state": r.state.value, "reason": r.reason, "for_s": round(now - r.since, 3),
                    "routable": len(r.routable), "node_epoch": r.node_epoch,
                    "weight_version": r.weight_version, "lost": r.lost_count}
                for n, r in sorted(self.nodes.items())}

    def live(self) -> list[str]:
        """Nodes whose agent is expected to answer (calls fan out to these)."""
        return sorted(n for n, r in self.nodes.items() if r.state is not NodeState.LOST)

    # -- what the client learned ----------------------------------------------------------

    def node_answered(self, node: str, routable: Mapping[str, Any], *, settle: bool = True) -> Change:
        """A node's routable answer. A node new, back after a loss or unavailable is JOINING,
        and admitted now if no round is open. settle=False: the union is judged (epoch, floor)
        only by a recompute() after a batch of answers, never half-way through it."""
        rec = self.nodes.get(node)
        before = None if rec is None else rec.state
        if rec is None or rec.state is not NodeState.UP:
            rec = self._set(node, NodeState.JOINING, "answers again" if rec else "answers", rec)
        rec.routable = [dict(e) for e in routable.get("engines") or () if isinstance(e, dict) and "name" in e]
        rec.node_epoch = routable.get("epoch")
        rec.rule = VersionRule.from_answer(routable)
        rec.weight_version = routable.get("weight_version")
        if isinstance(rec.weight_version, int) and (self.weight_version is None or rec.weight_version > self.weight_version):
            # Versions come only from the trainer's publishes: a node that has a newer one than
            # this client knows was published to by another client (this one only watches).
            self.weight_version, self.checkpoint, self.version_learned = rec.weight_version, None, True
        if rec.state is NodeState.JOINING and not self.round_open:
            rec.state, rec.reason = NodeState.UP, "admitted in a round gap"
        elif rec.state is NodeState.JOINING and self.admit_mid_round:
            rec.state, rec.reason = NodeState.UP, f"admitted inside round {self.round}"
        return self._recompute(node, before, settle=settle)

    def node_unavailable(self, node: str, reason: str) -> Change:
        rec = self.nodes.get(node)
        before = None if rec is None else rec.state
        if rec is not None and rec.state in (NodeState.UP, NodeState.JOINING):
            self._set(node, NodeState.UNAVAILABLE, reason, rec)
        return self._recompute(node, before)

    def node_lost(self, node: str, reason: str) -> Change:
        rec = self.nodes.get(node)
        before = None if rec is None else rec.state
        if rec is None or rec.state is not NodeState.LOST:
            rec = self._set(node, NodeState.LOST, reason, rec)
            rec.lost_count += 1
            rec.routable = []
        return self._recompute(node, before)

    def round_started(self, n: int) -> None:
        self.round, self.round_open = n, True

    def round_ended(self, n: int) -> list[str]:
        """The gap: JOINING nodes are admitted (returned; call recompute() after)."""
        self.round_open = False
        admitted = []
        for rec in self.nodes.values():
            if rec.state is NodeState.JOINING:
                rec.state, rec.since, rec.reason = NodeState.UP, self.clock(), "admitted in a round gap"
                admitted.append(rec.name)
        return sorted(admitted)

    def published(self, version: int, checkpoint: str | None, *, settle: bool = True) -> Change:
        self.weight_version, self.checkpoint, self.version_learned = version, checkpoint, False
        return self._recompute(settle=settle)

    def recompute(self) -> Change:
        return self._recompute()

    # -- internals ------------------------------------------------------------------------

    def _set(self, node: str, state: NodeState, reason: str, rec: NodeRecord | None) -> NodeRecord:
        if rec is None:
            rec = self.nodes[node] = NodeRecord(node, state, self.clock(), reason)
        else:
            rec.state, rec.since, rec.reason = state, self.clock(), reason
        return rec

    def _recompute(self, node: str | None = None, before: NodeState | None = None, *, settle: bool = True) -> Change:
        state = self.nodes[node].state if node in self.nodes else None
        entered = state if node is not None and state is not before else None
        if not settle:
            return Change(entered, before if entered else None)
        now = frozenset((e["name"], e.get("url"), e.get("weight_version")) for e in self.routable())
        moved = now != self._last_set
        if moved:
            self.epoch += 1
            self._last_set = now
        breached = restored = False
        if len(now) >= self.min_healthy:
            self._floor_armed = True
            if self.below_floor:
                self.below_floor, restored = False, True
        elif self._floor_armed and not self.below_floor:
            self.below_floor, breached = True, True
            self.floor_breaches += 1
        return Change(entered, before if entered else None, moved, breached, restored)


def membership_event(view: ClusterView, node: str | None, cause: str) -> dict[str, Any]:
    """The cluster's membership event: the shape of a daemon's (RolloutClient reads `epoch` and
    `routable`), with the node that moved it and why."""
    return {"event": Event.MEMBERSHIP.value, "ts": time.time(), "epoch": view.epoch, "routable": view.names(),
            "node": node, "cause": cause}


def floor_events(view: ClusterView, change: Change) -> Iterable[dict[str, Any]]:
    if change.breached:
        yield {"event": Event.FLOOR_BREACH.value, "ts": time.time(), "node": None, "scope": "cluster",
               "routable": len(view.names()), "min_healthy": view.min_healthy}
    if change.restored:
        yield {"event": Event.FLOOR_RESTORED.value, "ts": time.time(), "node": None, "scope": "cluster",
               "routable": len(view.names()), "min_healthy": view.min_healthy}
