"""Where the daemon's memory goes over a long run: the real daemon under tracemalloc (a wrapper
starts it with tracemalloc on; SIGUSR2 dumps a snapshot), two attached emulated engines (protocol
stand-ins), driven as the soak drives it: steps (round start and end, a publish, status and
routable reads) every `--pace` s, an event stream, and the soak's fuzzer at the control socket.
No fault. Snapshots after `--warm` s and at the end; printed: the daemon's RSS every 200 steps,
the traced growth between the snapshots (per step, per fuzzed request), and the largest
differences by traceback. RSS here includes tracemalloc's own cost.

    python bench/daemon_memory.py                      # 5 min warm-up, 40 min in all
    python bench/daemon_memory.py --warm 20 --minutes 1  # a smoke run

Exit 1 when the daemon died, the fleet never became routable or a snapshot never came.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

from vime.harness import emulated_engine
from vime.harness.local_daemon import free_port, standin_config
from vime.harness.soak import Fuzzer, proc_sample
from vime.supervisor.client import SupervisorClient

WRAPPER = r'''
import signal, sys, tracemalloc
tracemalloc.start(12)
out = sys.argv.pop(1)
n = [0]
def dump(*_):
    n[0] += 1
    tracemalloc.take_snapshot().dump(f"{out}/snap-{n[0]}.pickle")
    open(f"{out}/snap-{n[0]}.done", "w").close()
signal.signal(signal.SIGUSR2, dump)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
from vime.supervisor.daemon import main
sys.exit(main())
'''


class NoOutage:
    def in_outage(self, t: float) -> bool:
        return False


def snapshot(d: subprocess.Popen, tmp: Path, k: int, timeout: float = 120) -> Path:
    os.kill(d.pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while not (tmp / f"snap-{k}.done").exists():
        if d.poll() is not None or time.monotonic() > deadline:
            state = "alive" if d.poll() is None else f"exited {d.returncode}"
            raise RuntimeError(f"snapshot {k} never came (the daemon {state})")
        time.sleep(0.2)
    return tmp / f"snap-{k}.pickle"


def run(a: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="daemon-memory-"))
    ports = [free_port(), free_port()]
    engines = [subprocess.Popen([sys.executable, emulated_engine.__file__, "--base-port", str(p)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
               for p in ports]
    d = None
    stop = threading.Event()
    try:
        for e in engines:
            assert e.stdout is not None
            if not e.stdout.readline().startswith(b"ready"):
                print("an emulated engine did not start", file=sys.stderr)
                return 1
        cfg = standin_config(tmp, Path(sys.executable),
                             [{"name": f"r{i}", "url": f"http://127.0.0.1:{p}", "served_model_name": "tiny"}
                              for i, p in enumerate(ports)], health_check={"interval": 1.0, "timeout": 2.0})
        (tmp / "wrapper.py").write_text(WRAPPER)
        with open(tmp / "daemon.log", "w") as log:
            d = subprocess.Popen([sys.executable, str(tmp / "wrapper.py"), str(tmp), "--config", str(cfg)],
                                 stdout=log, stderr=log)
        sock = str(tmp / "run" / "supervisor.sock")
        client = SupervisorClient(sock, connect_timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.status()["routable"] == 2:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if d.poll() is not None or time.monotonic() > deadline:
                print(f"the fleet was not routable within 60 s; see {tmp / 'daemon.log'}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        fuzz = Fuzzer(sock, a.seed, ["r0", "r1"], NoOutage()).start()

        def events() -> None:
            c = SupervisorClient(sock, connect_timeout=30)
            while not stop.is_set():
                try:
                    for _ in c.events():
                        if stop.is_set():
                            return
                except Exception:  # noqa: BLE001 - the stream ended: open it again
                    time.sleep(1)

        threading.Thread(target=events, daemon=True).start()
        steps, t0 = 0, time.monotonic()
        snaps: list[tuple[int, int, Path]] = []
        rss: list[tuple[int, int, int, int]] = []
        total = a.minutes * 60
        while time.monotonic() - t0 < total:
            steps += 1
            client.start_round(steps)
            client.routable_engines()
            client.end_round(steps)
            client.publish_weights(steps)
            client.status()
            time.sleep(a.pace)
            el = time.monotonic() - t0
            if (not snaps and el >= a.warm) or (len(snaps) == 1 and el >= total - 5):
                snaps.append((steps, fuzz.sent, snapshot(d, tmp, len(snaps) + 1)))
            if steps % 200 == 0:
                rss.append((round(el), steps, fuzz.sent, proc_sample(d.pid)["daemon_rss"] // 1024))
        fuzz.stop()
        if len(snaps) < 2:
            print("fewer than two snapshots: --minutes must leave time after --warm", file=sys.stderr)
            return 1
    finally:
        stop.set()
        if d is not None and d.poll() is None:
            d.send_signal(signal.SIGTERM)
            d.wait(30)
        for e in engines:
            os.killpg(e.pid, signal.SIGKILL)
            e.wait()
    print(f"{'s':>6}{'steps':>8}{'fuzzed':>8}{'RSS MiB':>10}")
    for el, st, fz, kib in rss:
        print(f"{el:>6}{st:>8}{fz:>8}{kib / 1024:>10.1f}")
    (s1, f1, p1), (s2, f2, p2) = snaps
    first, last = tracemalloc.Snapshot.load(str(p1)), tracemalloc.Snapshot.load(str(p2))
    grew = sum(st.size_diff for st in last.compare_to(first, "filename"))
    print(f"\nbetween the snapshots: {s2 - s1} steps, {f2 - f1} fuzzed requests; traced memory grew "
          f"{grew / 1024:.1f} KiB ({grew / max(1, s2 - s1):.0f} B/step, {grew / max(1, f2 - f1):.0f} B/fuzzed)")
    for st in last.compare_to(first, "traceback")[:a.top]:
        print(f"\n{st.size_diff / 1024:+.1f} KiB, {st.count_diff:+d} blocks")
        for line in st.traceback.format()[-12:]:
            print("   ", line)
    print(f"\nfolder: {tmp}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=float, default=300.0, help="seconds before the first snapshot (default 300)")
    ap.add_argument("--minutes", type=float, default=40.0, help="the whole run, minutes (default 40)")
    ap.add_argument("--pace", type=float, default=0.5, help="seconds of pause after each step (default 0.5)")
    ap.add_argument("--seed", type=int, default=7, help="the fuzzer's seed (default 7)")
    ap.add_argument("--top", type=int, default=12, help="tracebacks printed (default 12)")
    a = ap.parse_args(argv)
    if not (a.warm >= 0 and a.pace >= 0 and a.minutes * 60 > a.warm + 10):
        ap.error("--minutes must leave more than 10 s after --warm; --warm and --pace must be >= 0")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
