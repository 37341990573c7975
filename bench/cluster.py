"""The cluster client (vime.cluster) over 1 / 4 / 16 simulated Ray nodes, against the same calls
made straight to each node's daemon from the driver, in the same run.

PROTOCOL STAND-INS: the engines here are harness/standin_engine.py (one process per simulated
node serving that node's 8 stand-ins on its own loopback address, attached to the node's daemon
by url). They answer the parts of vLLM's protocol the daemon uses; they are not vLLM. The
cluster client's behaviour with real vLLM engines is tested in tests/cluster/. The daemons,
the Ray cluster (ray.cluster_utils: one raylet per simulated node, harness/ray_nodes.py) and
the node agents are the real ones; every "node" is on this one machine, so no figure here
includes a network between machines.

For each node count N it reports:

* latency, p50 / p95 over --reps, of a round boundary (start_round + end_round on every node)
  and of routable_engines(): through the blocking ClusterClient (driver -> agent on each node
  -> its daemon's Unix socket), and direct (the driver calls each node's socket itself with
  SupervisorClient): "seq" one node after another, "conc" all nodes at once from a thread pool.
  The ratio is cluster / direct: 1.0 means the cluster layer costs nothing over doing it by hand.
  The three ways run interleaved, rep by rep, so load on the shared machine hits them alike.
* removal: a node is removed (its raylet SIGKILLed, no grace: RayNodes.remove; its daemon
  SIGKILLed and its stand-in server with it, as Node.kill_daemon_and_engines does to spawned
  engines); the time from the removal until its engines leave the cluster's routable list, seen
  two ways in separate trials: on the merged event stream (the first membership event without
  them; nobody polls) and by polling routable_engines() every --poll-every s (the first answer
  without them). Median / max over --removals trials each. The baseline, in the same trials, is
  Ray's own verdict: the time until its GCS marks the raylet dead (ray.nodes()). The node comes
  back at the same address between trials (stand-ins, daemon, raylet), after that verdict (while
  Ray still lists the dead raylet alive, the client keeps the node's agent there until its
  unavailable_grace runs out). The time until its engines are routable again is kept in the
  JSON ("rejoin_s"; it includes the client's backoff for an agent re-placed within 60 s of its
  last placement), with each trial's events about the node ("timeline").
* setup: the time to start the Ray head and N raylets, and to place the agents until all N x 8
  engines are routable; the memory (PSS) of Ray's processes (GCS, raylets, agents and Ray's
  per-node helpers), the daemons and the stand-in servers. A node count that does not fit (an
  estimate over MemAvailable, or a start that fails) is reported as such, never estimated.

The cluster client runs with its defaults (its timeouts, grace and retry are printed under the
table and kept in the JSON). Daemons probe at --interval (2 s: 128 engines on 2 cores).

    python bench/cluster.py --nodes 1,4,16 --engines-per-node 8 --reps 200 --removals 3 --out cluster.json
    python bench/cluster.py --quick --out /tmp/cluster-quick.json     # 1 and 2 nodes, about a minute

--quick is a smoke run: 20 reps, one removal each way, a node brought back (and Ray's verdict
awaited) only where the next trial needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# Ray's own processes log at INFO otherwise; set before Ray is imported (the children inherit it).
os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
# Each Ray node started in this process puts a SIGTERM handler in place that drains it for 30 s
# first; this run puts its own back (Rig.add) and needs no drain.
os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.local_daemon import write_config  # noqa: E402  (bench/ is on sys.path when run)
from vime.harness.ray_nodes import Node, RayNodes, cleanup, node_address  # noqa: E402
from vime.supervisor.client import SupervisorClient  # noqa: E402
from vime.supervisor.engine.process import all_procs, proc_stat  # noqa: E402

WAIT = 120.0  # the longest any one thing may take to start or to be seen before the run gives up


def say(msg: str) -> None:
    print(msg, flush=True)


# -- the stand-in server of one node -------------------------------------------------------------

def serve_standins(host: str, base: int, count: int) -> None:
    """The hidden --serve-standins mode: `count` stand-ins on host:base.. in this process."""
    import asyncio

    from vime.harness.standin_engine import serve

    async def main() -> None:
        await serve(base, count, host)
        print("ready", flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


def free_range_on(host: str, n: int, start: int = 30000) -> int:
    """The first of n consecutive ports free on host (a node's own address)."""
    for base in range(start, 60000 - n, 64):
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, p))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


@dataclass
class SimNode:
    """One simulated node: its daemon (ray_nodes.Node), its stand-in server, its ports."""

    node: Node
    base: int
    count: int
    standins: subprocess.Popen | None = None
    client: SupervisorClient | None = None

    @property
    def address(self) -> str:
        return self.node.address

    def start_standins(self) -> None:
        log = self.node.root / "standins.log"  # its stderr: a pipe nobody reads could fill and stall it
        with open(log, "ab") as err:
            self.standins = subprocess.Popen(
                [sys.executable, __file__, "--serve-standins", self.address, str(self.base), str(self.count)],
                stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        if b"ready" not in self.standins.stdout.readline():  # "" when it exited
            self.kill_standins()
            raise RuntimeError(f"the stand-in server on {self.address}:{self.base} did not start: "
                               f"{log.read_text(errors='replace').strip()[-800:]}")

    def kill_standins(self) -> None:
        if self.standins is not None and self.standins.poll() is None:
            self.standins.kill()
        if self.standins is not None:
            self.standins.wait(10)

    def start_daemon(self) -> None:
        self.node.start_daemon()
        self.client = SupervisorClient(self.node.sock, connect_timeout=30)
        until(lambda: self.client.status()["routable"] == self.count, WAIT,
              f"{self.count} stand-ins routable on {self.address}'s daemon")

    def kill(self) -> None:
        """The node's processes die at once, as on a node's loss (no clean-up)."""
        self.node.kill_daemon_and_engines()
        self.kill_standins()


def sim_node(root: Path, i: int, count: int, interval: float) -> SimNode:
    address = node_address(i)
    root.mkdir(parents=True, exist_ok=True)
    base = free_range_on(address, count)
    run_dir = tempfile.mkdtemp(prefix="vime-node-", dir="/tmp")  # a short socket path
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": run_dir, "log_dir": str(root / "logs"), "log_level": "warning",
                    "stop_timeout": 2.0, "min_healthy": 0},
        health_check={"first_wait": 30.0, "interval": interval, "timeout": min(1.0, 0.9 * interval),
                      "failure_threshold": 3},
        engines=[{"name": f"e{k}", "url": f"http://{address}:{base + k}", "served_model_name": "tiny"}
                 for k in range(count)],
    )
    return SimNode(Node(address, root, cfg, run_dir), base, count)


def until(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g}s: {what}")
        time.sleep(step)


# -- memory --------------------------------------------------------------------------------------

def pss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def descendants(root: int) -> dict[int, str]:
    """pid -> comm of every live process below root."""
    procs = [st for st in all_procs() if st.state != "Z"]
    kids: dict[int, list[Any]] = {}
    for st in procs:
        kids.setdefault(st.ppid, []).append(st)
    out, todo = {}, [root]
    while todo:
        for st in kids.get(todo.pop(), ()):
            out[st.pid] = st.comm
            todo.append(st.pid)
    return out


def process_name(pid: int, comm: str) -> str:
    """comm, or for a Python process the script it runs (Ray's monitor.py, log_monitor.py, ...)."""
    if not comm.startswith("python"):
        return comm
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    script = next((a.decode(errors="replace") for a in argv[1:] if a.endswith(b".py")), None)
    return f"python {Path(script).name}" if script else comm


def kinds(nodes: list[SimNode]) -> tuple[dict[int, str], set[int], set[int]]:
    """The processes this run started, by kind: Ray's (pid -> comm: everything below the driver
    that is not a daemon or a stand-in server), the daemons', the stand-in servers'."""
    below = descendants(os.getpid())
    daemons: set[int] = set()
    standins: set[int] = set()
    for n in nodes:
        for proc, into in ((n.node.daemon and n.node.daemon.proc, daemons), (n.standins, standins)):
            if proc is not None and proc.poll() is None:
                into |= {proc.pid, *descendants(proc.pid)}  # their own children: none for attached engines
    ray = {pid: comm for pid, comm in below.items() if pid not in daemons and pid not in standins}
    return ray, daemons, standins


def idle_cpu(nodes: list[SimNode], seconds: float) -> dict[str, float]:
    """What the rig burns with nobody calling it, in % of one core over `seconds`: Ray's
    processes, the daemons (probing their engines), the stand-in servers (answering)."""
    ray, daemons, standins = kinds(nodes)
    groups = {"ray": set(ray), "daemons": daemons, "standins": standins, "driver": {os.getpid()}}

    def ticks() -> dict[str, int]:
        return {k: sum(st.cpu_ticks for p in pids if (st := proc_stat(p)) is not None) for k, pids in groups.items()}

    t0, a = time.monotonic(), ticks()
    time.sleep(seconds)
    b, dt = ticks(), time.monotonic() - t0
    tick = os.sysconf("SC_CLK_TCK")
    out = {f"idle_cpu_{k}_pct": round(100 * (b[k] - a[k]) / tick / dt, 1) for k in groups}
    out["idle_cpu_pct"] = round(sum(out.values()), 1)
    return out


def memory(nodes: list[SimNode]) -> dict[str, Any]:
    """PSS by kind of every process this run started (kinds()), and the driver's."""
    ray, daemons, standins = kinds(nodes)
    by_comm: dict[str, float] = {}
    for pid, comm in ray.items():
        name = process_name(pid, comm)
        by_comm[name] = by_comm.get(name, 0.0) + pss_mib(pid)
    return {"ray_mib": round(sum(by_comm.values()), 1), "ray_processes": len(ray),
            "ray_by_process": {k: round(v, 1) for k, v in sorted(by_comm.items(), key=lambda kv: -kv[1])},
            "daemons_mib": round(sum(pss_mib(p) for p in daemons), 1),
            "standins_mib": round(sum(pss_mib(p) for p in standins), 1),
            "driver_mib": round(pss_mib(os.getpid()), 1)}


# -- figures -------------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stats_ms(xs: list[float]) -> dict[str, Any]:
    return {"p50_ms": round(pct(xs, 0.5) * 1e3, 3), "p95_ms": round(pct(xs, 0.95) * 1e3, 3), "n": len(xs),
            "samples_ms": [round(x * 1e3, 3) for x in xs]}


def ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b > 0 else float("nan")


# -- the merged event stream, read on a thread as a trainer would --------------------------------

class Recorder:
    def __init__(self, sup: Any):
        self.events: list[tuple[float, dict]] = []  # (monotonic arrival, event)
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._run, args=(sup,), daemon=True, name="bench-events")
        self._t.start()

    def _run(self, sup: Any) -> None:
        for ev in sup.events():
            with self._lock:
                self.events.append((time.monotonic(), ev))

    def mark(self) -> int:
        with self._lock:
            return len(self.events)

    def since(self, mark: int) -> list[tuple[float, dict]]:
        with self._lock:
            return list(self.events[mark:])

    def first(self, pred: Callable[[dict], bool], after: int) -> tuple[float, dict] | None:
        with self._lock:
            return next(((t, ev) for t, ev in self.events[after:] if pred(ev)), None)


# -- one node count ------------------------------------------------------------------------------

@dataclass
class Rig:
    """Everything started for one node count; close() stops all of it whatever failed."""

    n: int
    per_node: int
    interval: float
    tmp: Path
    nodes: list[SimNode] = field(default_factory=list)
    ray: RayNodes | None = None
    sup: Any = None
    pool: ThreadPoolExecutor | None = None
    started: dict[int, Any] = field(default_factory=dict)  # pid -> ProcStat of Ray's processes
    idle_window: float = 5.0  # seconds over which the rig's idle CPU is measured

    def start(self, setup: dict[str, Any]) -> None:
        t0 = time.monotonic()
        for i in range(self.n):
            sim = sim_node(self.tmp / f"n{self.n}-{i}", i, self.per_node, self.interval)
            self.nodes.append(sim)
            sim.start_standins()
            sim.start_daemon()
        setup["daemons_s"] = round(time.monotonic() - t0, 2)
        say(f"  {self.n} daemons with {self.per_node} stand-ins each up in {setup['daemons_s']:.1f} s")

        t0 = time.monotonic()
        self.ray = RayNodes()
        self.ray.connect()
        signal.signal(signal.SIGTERM, interrupted)  # ray.init put its own (sys.exit) in place of ours
        self.note_processes()
        setup["ray_head_s"] = round(time.monotonic() - t0, 2)
        setup["ray_head_mib"] = memory(self.nodes)["ray_mib"]
        t1 = time.monotonic()
        for sim in self.nodes:
            self.add(sim)
        setup["ray_nodes_s"] = round(time.monotonic() - t1, 2)
        say(f"  Ray head in {setup['ray_head_s']:.1f} s, {self.n} raylets in {setup['ray_nodes_s']:.1f} s")

        from vime.cluster import ClusterClient

        t2 = time.monotonic()
        self.sup = ClusterClient([s.address for s in self.nodes],
                                 socket_path={s.address: s.node.sock for s in self.nodes},
                                 connect_timeout_s=WAIT)
        want = self.n * self.per_node
        until(lambda: len(self.sup.routable_engines()["engines"]) == want, WAIT,
              f"{want} engines routable through the cluster client", step=0.2)
        setup["agents_s"] = round(time.monotonic() - t2, 2)
        setup["start_total_s"] = round(time.monotonic() - t0, 2)
        time.sleep(2 * self.interval)  # the daemons' heartbeats in their steady state
        setup.update(memory(self.nodes))
        setup.update(idle_cpu(self.nodes, self.idle_window))
        setup["ray_per_node_mib"] = round((setup["ray_mib"] - setup["ray_head_mib"]) / self.n, 1)
        setup["mem_available_mib"] = round(mem_available_mib())
        say(f"  agents placed, {want} engines routable in {setup['agents_s']:.1f} s; Ray {setup['ray_mib']:.0f} MiB "
            f"PSS ({setup['ray_processes']} processes), daemons {setup['daemons_mib']:.0f} MiB, "
            f"stand-ins {setup['standins_mib']:.0f} MiB; idle, the rig uses {setup['idle_cpu_pct']:.0f}% of a core "
            f"(Ray {setup['idle_cpu_ray_pct']:.0f}%, daemons {setup['idle_cpu_daemons_pct']:.0f}%)")
        self.pool = ThreadPoolExecutor(max_workers=self.n, thread_name_prefix="bench-direct")
        self.note_processes()  # the raylets' helpers and the agents, started after their raylets

    def add(self, sim: SimNode) -> None:
        """The node's raylet; SIGTERM is this run's again (the new Ray node took it)."""
        sim.node.ray_node = self.ray.add(sim.address)
        signal.signal(signal.SIGTERM, interrupted)
        self.note_processes()

    def note_processes(self) -> None:
        """Remember Ray's processes while they are below this one: a raylet's helpers outlive a
        raylet killed by a Ctrl-C for seconds (they poll for their parent), under init, and
        this run ends only after them."""
        for pid in descendants(os.getpid()):
            st = proc_stat(pid)
            if st is not None:
                self.started.setdefault(pid, st)

    def _stop_ray(self) -> None:
        """The driver leaves, the raylets are killed (a graceful drain can wait 30 s a node when
        interrupted mid-start), then the head."""
        import ray

        if self.ray is None:
            return
        self.note_processes()
        ray.shutdown()
        for sim in self.nodes:
            if sim.node.ray_node is not None:
                self.ray.remove(sim.node.ray_node)
                sim.node.ray_node = None
        self.ray.cluster.shutdown()

        def left() -> list[int]:
            return [pid for pid, st in self.started.items() if (now := proc_stat(pid)) is not None
                    and now.start_time == st.start_time and now.state != "Z"]
        deadline = time.monotonic() + 10
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        steps = [
            ("cluster client", lambda: self.sup is not None and self.sup.shutdown()),
            ("thread pool", lambda: self.pool is not None and self.pool.shutdown(wait=False)),
            ("daemons", lambda: cleanup([s.node for s in self.nodes])),
            ("stand-in servers", lambda: [s.kill_standins() for s in self.nodes]),
            ("Ray cluster", self._stop_ray),
        ]
        for what, step in steps:
            t0 = time.monotonic()
            try:
                step()
            except BaseException as e:  # noqa: BLE001  (clean up the rest whatever this was)
                say(f"  (clean-up of the {what} failed: {type(e).__name__}: {e})")
            if time.monotonic() - t0 > 5:
                say(f"  (clean-up of the {what} took {time.monotonic() - t0:.0f} s)")
        self.sup = self.ray = self.pool = None


def measure_latency(rig: Rig, reps: int, warmup: int, counter: list[int]) -> dict[str, Any]:
    sup, clients, pool = rig.sup, [s.client for s in rig.nodes], rig.pool

    def next_round() -> int:
        counter[0] += 1
        return counter[0]

    def cluster_round() -> None:
        r = next_round()
        sup.start_round(r)
        sup.end_round(r)

    def seq_round() -> None:
        r = next_round()
        for c in clients:
            c.start_round(r)
        for c in clients:
            c.end_round(r)

    def conc_round() -> None:
        r = next_round()
        list(pool.map(lambda c: c.start_round(r), clients))
        list(pool.map(lambda c: c.end_round(r), clients))

    ways: dict[str, dict[str, Callable[[], Any]]] = {
        "cluster": {"round": cluster_round, "routable": sup.routable_engines},
        "direct_seq": {"round": seq_round, "routable": lambda: [c.routable_engines() for c in clients]},
        "direct_conc": {"round": conc_round, "routable": lambda: list(pool.map(lambda c: c.routable_engines(), clients))},
    }
    load_before = os.getloadavg()[0]
    samples: dict[str, dict[str, list[float]]] = {w: {"round": [], "routable": []} for w in ways}
    order = list(ways)
    for i in range(warmup + reps):
        for way in order[i % 3:] + order[:i % 3]:  # rotate who goes first
            for call, fn in ways[way].items():
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    samples[way][call].append(dt)
    out: dict[str, Any] = {"load": [round(load_before, 2), round(os.getloadavg()[0], 2)]}  # 1-min averages
    for call in ("round", "routable"):
        row = {way: stats_ms(samples[way][call]) for way in ways}
        c = row["cluster"]["p50_ms"]
        row["ratio_p50_seq"] = ratio(c, row["direct_seq"]["p50_ms"])
        row["ratio_p50_conc"] = ratio(c, row["direct_conc"]["p50_ms"])
        row["ratio_p95_seq"] = ratio(row["cluster"]["p95_ms"], row["direct_seq"]["p95_ms"])
        row["ratio_p95_conc"] = ratio(row["cluster"]["p95_ms"], row["direct_conc"]["p95_ms"])
        out[call] = row
    # Every engine still routable through the cluster client after the reps (a sanity check).
    left = len(sup.routable_engines()["engines"])
    if left != rig.n * rig.per_node:
        raise RuntimeError(f"only {left} of {rig.n * rig.per_node} engines routable after the latency reps")
    return out


def removal_trial(rig: Rig, rec: Recorder, sim: SimNode, mode: str, poll_every: float, rejoin: bool,
                  baseline: bool = True) -> dict[str, Any]:
    sup, prefix = rig.sup, sim.address + "/"
    has_node = lambda names: any(n.startswith(prefix) for n in names)  # noqa: E731
    polled: dict[str, Any] = {"calls": [], "seen": None}
    stop = threading.Event()

    def poller(t0_box: list[float]) -> None:
        while not stop.is_set():
            t = time.monotonic()
            names = [e["name"] for e in sup.routable_engines()["engines"]]
            done = time.monotonic()
            polled["calls"].append(done - t)
            if t0_box and not has_node(names):
                polled["seen"] = done
                return
            time.sleep(poll_every)

    mark = rec.mark()
    t0_box: list[float] = []
    th = None
    if mode == "poll":
        th = threading.Thread(target=poller, args=(t0_box,), daemon=True, name="bench-poll")
        th.start()
        until(lambda: polled["calls"], 30, "a first poll")
    ray_id = sim.node.ray_node.node_id
    t0 = time.monotonic()
    t0_box.append(t0)
    rig.ray.remove(sim.node.ray_node)
    sim.node.ray_node = None
    sim.kill()
    killed = time.monotonic() - t0
    out: dict[str, Any] = {"node": sim.address, "observed_by": mode, "kill_s": round(killed, 3)}
    try:
        if mode == "events":
            got = until(lambda: rec.first(lambda e: e.get("event") == "membership" and not has_node(e["routable"]), mark),
                        WAIT, f"a membership event without {sim.address}'s engines")
            out["seen_s"] = round(got[0] - t0, 3)
        else:
            until(lambda: polled["seen"] or (th is not None and not th.is_alive()), WAIT,
                  f"a routable_engines() answer without {sim.address}'s engines")
            if polled["seen"] is None:
                raise RuntimeError("the poller stopped (routable_engines raised)")
            out["seen_s"] = round(polled["seen"] - t0, 3)
            out["poll_calls"] = len(polled["calls"])
            out["poll_call_max_s"] = round(max(polled["calls"]), 3)
    except TimeoutError as e:
        out["seen_s"] = None
        out["error"] = str(e)
    finally:
        stop.set()
    if th is not None:
        th.join(WAIT)
    # The baseline: Ray's own verdict on the node (its GCS marks the raylet dead). The node is
    # re-added only after it, so that each trial starts from a cluster that settled: while Ray
    # still lists the dead raylet, the client keeps the node's agent there (unavailable_grace).
    import ray

    if baseline or rejoin:
        until(lambda: not any(n["NodeID"] == ray_id and n["Alive"] for n in ray.nodes()), WAIT,
              f"Ray marking the removed raylet at {sim.address} dead", step=0.1)
        out["ray_dead_s"] = round(time.monotonic() - t0, 2)
    if rejoin:
        sim.start_standins()  # the node comes back at the same address: stand-ins, daemon (journal restored), raylet
        sim.start_daemon()
        t1 = time.monotonic()
        rig.add(sim)
        want = rig.n * rig.per_node
        until(lambda: len(sup.routable_engines()["engines"]) == want, WAIT,
              f"{sim.address}'s engines routable again", step=0.1)
        out["rejoin_s"] = round(time.monotonic() - t1, 2)
        rig.note_processes()
    # What the stream said about the node meanwhile, and when (s after the removal).
    said = [(t, ev) for t, ev in rec.since(mark) if ev.get("node") == sim.address]
    out["timeline"] = [{"s": round(t - t0, 3), "event": ev["event"],
                        **({"why": str(ev.get("reason") or ev.get("cause"))[:120]}
                           if ev.get("reason") or ev.get("cause") else {})}
                       for t, ev in said if ev.get("event") != "keepalive"][:40]
    return out


def measure_removals(rig: Rig, trials: int, poll_every: float, quick: bool = False) -> dict[str, Any]:
    rec = Recorder(rig.sup)
    until(lambda: rec.first(lambda e: e.get("event") == "hello", 0), 30, "the cluster's hello")
    plan = [mode for _ in range(trials) for mode in ("events", "poll")]
    runs = []
    for k, mode in enumerate(plan):
        sim = rig.nodes[k % rig.n]  # rotate: a node re-placed within 60 s is backed off
        # --quick brings a node back only where the next trial needs it (one node), and waits for
        # Ray's verdict only to do that.
        rejoin = k < len(plan) - 1 and (not quick or rig.n == 1)
        r = removal_trial(rig, rec, sim, mode, poll_every, rejoin=rejoin, baseline=rejoin or not quick)
        runs.append(r)
        seen = "not seen" if r["seen_s"] is None else f"{r['seen_s']:.2f} s"
        say(f"  removal {k + 1}/{len(plan)} of {sim.address} ({mode}): out of routing after {seen}"
            + (f"; Ray marked it dead after {r['ray_dead_s']:.1f} s" if "ray_dead_s" in r else "")
            + (f"; back in {r['rejoin_s']:.1f} s" if "rejoin_s" in r else ""))
    out: dict[str, Any] = {"trials": runs}
    for mode in ("events", "poll"):
        xs = [r["seen_s"] for r in runs if r["observed_by"] == mode and r["seen_s"] is not None]
        dead = [r["ray_dead_s"] for r in runs if r["observed_by"] == mode and "ray_dead_s" in r]
        med = round(statistics.median(xs), 3) if xs else None
        ray_med = round(statistics.median(dead), 3) if dead else None
        out[mode] = {"trials": sum(r["observed_by"] == mode for r in runs), "seen": len(xs), "median_s": med,
                     "max_s": round(max(xs), 3) if xs else None, "ray_dead_median_s": ray_med,
                     "ratio_to_ray": ratio(med, ray_med) if med is not None and ray_med else None}
    return out


def run_nodes(n: int, args: argparse.Namespace, tmp: Path, counter: list[int], est_per_node: float | None
              ) -> dict[str, Any]:
    result: dict[str, Any] = {"nodes": n, "engines": n * args.engines_per_node, "setup": {}}
    avail = mem_available_mib()
    if est_per_node is not None and n * est_per_node > 0.8 * avail:
        result["error"] = (f"does not fit: {n} nodes need about {n * est_per_node:.0f} MiB (measured "
                           f"{est_per_node:.0f} MiB per node), {avail:.0f} MiB available")
        say(f"  {result['error']}")
        return result
    rig = Rig(n, args.engines_per_node, args.interval, tmp, idle_window=2.0 if args.quick else 5.0)
    try:
        rig.start(result["setup"])
        say(f"  latency: {args.reps} reps (+{args.warmup} warm-up) of each call, three ways")
        result["latency"] = measure_latency(rig, args.reps, args.warmup, counter)
        result["removal"] = measure_removals(rig, args.removals, args.poll_every, args.quick)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001  (say what failed, clean up, go on with the next N)
        result["error"] = f"{type(e).__name__}: {e}"
        result["setup"]["mem_available_mib_at_failure"] = round(mem_available_mib())
        say(f"  FAILED at {n} nodes: {result['error']}")
    finally:
        rig.close()
    return result


# -- output --------------------------------------------------------------------------------------

def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(data: dict[str, Any]) -> str:
    a = data["args"]
    lines = [f"cluster client vs direct sockets: {a['engines_per_node']} stand-in engines per node, "
             f"{a['reps']} reps; p50 / p95 in ms",
             "  round = start_round + end_round on every node; direct seq: the driver calls each node's socket "
             "in turn; conc: all nodes at once (thread pool); ratio = cluster / direct; load: the machine's "
             "1-minute load average when the reps began and ended",
             f"{'nodes':>5} {'engines':>7} {'call':>9} {'cluster p50':>11} {'p95':>7} {'seq p50':>8} {'p95':>7} "
             f"{'conc p50':>8} {'p95':>7} {'p50/seq':>7} {'p50/conc':>8} {'load':>9}"]
    for run in data["runs"]:
        lat = run.get("latency")
        if not lat:
            lines.append(f"{run['nodes']:>5} {run['engines']:>7}   {run.get('error', 'no figures')}")
            continue
        for call in ("round", "routable"):
            r = lat[call]
            lines.append(
                f"{run['nodes']:>5} {run['engines']:>7} {call:>9} {r['cluster']['p50_ms']:11.2f} "
                f"{r['cluster']['p95_ms']:7.2f} {r['direct_seq']['p50_ms']:8.2f} {r['direct_seq']['p95_ms']:7.2f} "
                f"{r['direct_conc']['p50_ms']:8.2f} {r['direct_conc']['p95_ms']:7.2f} {fmt(r['ratio_p50_seq']):>7} "
                f"{fmt(r['ratio_p50_conc']):>8} {'%.1f-%.1f' % tuple(lat['load']):>9}")
    lines += ["", "node removal (raylet SIGKILL + daemon and stand-ins SIGKILL) -> its engines out of the cluster's "
                  "routable list, s",
              "  baseline: Ray's own verdict, its GCS marking the raylet dead, in the same trials; ratio = median / "
              "Ray's median",
              f"{'nodes':>5} {'seen on':>24} {'trials':>6} {'median':>7} {'max':>6} {'Ray dead':>8} {'ratio':>6}"]
    for run in data["runs"]:
        rm = run.get("removal")
        if not rm:
            continue
        for mode, label in (("events", "event stream"), ("poll", f"polling every {a['poll_every']:g} s")):
            m = rm[mode]
            seen = f"{m['seen']}/{m['trials']}" if m["seen"] != m["trials"] else str(m["trials"])
            lines.append(f"{run['nodes']:>5} {label:>24} {seen:>6} {fmt(m['median_s']):>7} {fmt(m['max_s']):>6} "
                         f"{fmt(m['ray_dead_median_s'], '.1f'):>8} {fmt(m['ratio_to_ray']):>6}")
    lines += ["", "setup: Ray head + raylets, agents placed until every engine is routable; memory is PSS, MiB",
              "  idle cpu: % of one core the whole rig uses with nobody calling it (Ray's processes, the daemons "
              "probing, the stand-ins)",
              f"{'nodes':>5} {'ray start s':>11} {'agents s':>8} {'ray MiB':>8} {'per node':>8} {'procs':>5} "
              f"{'daemons':>7} {'stand-ins':>9} {'idle cpu %':>10}"]
    for run in data["runs"]:
        s = run["setup"]
        if "ray_mib" not in s:
            lines.append(f"{run['nodes']:>5}   {run.get('error', 'no figures')}")
            continue
        lines.append(f"{run['nodes']:>5} {s['ray_head_s'] + s['ray_nodes_s']:11.1f} {s['agents_s']:8.1f} "
                     f"{s['ray_mib']:8.0f} {s['ray_per_node_mib']:8.0f} {s['ray_processes']:>5} "
                     f"{s['daemons_mib']:7.0f} {s['standins_mib']:9.0f} {s['idle_cpu_pct']:10.0f}")
    m = data["machine"]
    lines.append("(cluster client defaults: " + ", ".join(f"{k} {v:g} s" for k, v in m["client"].items()) + ")")
    lines.append(f"(PROTOCOL STAND-IN engines; every node on this machine: {m['cpus']} cores, "
                 f"{m['mem_total_gib']} GiB, load {m['load_before']} before, {m['load_after']} after; "
                 f"Ray {m['ray']}; {data['elapsed_s']:.0f} s)")
    for run in data["runs"]:
        if run.get("error"):
            lines.append(f"({run['nodes']} nodes: {run['error']})")
    return "\n".join(lines)


def interrupted(*_: Any) -> None:
    raise KeyboardInterrupt


def client_defaults() -> dict[str, Any]:
    """The cluster client's timing settings this run uses: its defaults."""
    import inspect

    from vime.cluster import AsyncClusterClient

    params = inspect.signature(AsyncClusterClient.__init__).parameters
    return {k: p.default for k, p in params.items()
            if isinstance(p.default, (int, float)) and not isinstance(p.default, bool)
            and any(w in k for w in ("timeout", "grace", "retry", "interval"))}


def machine() -> dict[str, Any]:
    import ray

    total = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = ""
    return {"cpus": os.cpu_count(), "mem_total_gib": round(total / 1024 / 1024, 1), "client": client_defaults(),
            "mem_available_mib": round(mem_available_mib()), "platform": platform.platform(),
            "python": platform.python_version(), "ray": ray.__version__, "commit": commit,
            "load_before": round(os.getloadavg()[0], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default=None, help="node counts, comma-separated (default 1,4,16)")
    ap.add_argument("--engines-per-node", type=int, default=8)
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions of each call (default 200)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed repetitions first (default 5)")
    ap.add_argument("--removals", type=int, default=None,
                    help="node removals observed each way, per node count (default 3)")
    ap.add_argument("--poll-every", type=float, default=0.05, help="seconds between routable_engines() polls")
    ap.add_argument("--interval", type=float, default=2.0, help="the daemons' health-check interval, s")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--quick", action="store_true", help="1 and 2 nodes, 20 reps, 1 removal each way")
    ap.add_argument("--serve-standins", nargs=3, metavar=("HOST", "BASE", "COUNT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_standins:
        host, base, count = args.serve_standins
        serve_standins(host, int(base), int(count))
        return 0
    quick = {"nodes": "1,2", "reps": 20, "warmup": 3, "removals": 1}
    full = {"nodes": "1,4,16", "reps": 200, "warmup": 5, "removals": 3}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        counts = [int(x) for x in str(args.nodes).split(",") if x.strip()]
    except ValueError:
        ap.error(f"--nodes {args.nodes!r}: give node counts separated by commas, e.g. 1,4,16")
    if not counts or min(counts) < 1 or max(counts) > 250 or args.engines_per_node < 1 or args.reps < 1:
        ap.error("--nodes: counts from 1 to 250 (one loopback address each); --engines-per-node, --reps: at least 1")
    if args.warmup < 0 or args.removals < 0 or not args.interval > 0 or not args.poll_every > 0:
        ap.error("--warmup and --removals: 0 or more; --interval and --poll-every: seconds above 0")
    # SIGTERM ends the run the way Ctrl-C does: everything started is stopped.
    signal.signal(signal.SIGTERM, interrupted)

    data: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                     if k != "serve_standins"}, "machine": machine(), "runs": []}
    t_start = time.monotonic()
    counter = [0]
    est: float | None = None
    rc = 0
    with tempfile.TemporaryDirectory(prefix="vime-bench-cluster-") as t:
        try:
            for n in counts:
                say(f"{n} node{'s' if n > 1 else ''} x {args.engines_per_node} engines:")
                run = run_nodes(n, args, Path(t), counter, est)
                data["runs"].append(run)
                s = run["setup"]
                if "ray_mib" in s:
                    est = max(est or 0.0, (s["ray_mib"] - s["ray_head_mib"] + s["daemons_mib"] + s["standins_mib"]) / n)
                if run.get("error"):
                    rc = 1
        except (KeyboardInterrupt, SystemExit):
            say("interrupted: everything this run started is stopped")
            data["interrupted"] = True
            rc = 130
    data["machine"]["load_after"] = round(os.getloadavg()[0], 2)
    data["elapsed_s"] = round(time.monotonic() - t_start, 1)
    say("")
    say(table(data))
    if args.out:
        args.out.write_text(json.dumps(data, indent=1, allow_nan=False, default=str) + "\n")
        say(f"(figures: {args.out})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
