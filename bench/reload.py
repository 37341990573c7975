"""Control-socket calls during reloads (SIGHUP) under load: the listening socket handed across
the exec, against a reload that closes it and binds a new one (VIME_SUPERVISOR_SOCKET_HANDOVER=0,
how every reload worked before the handover), both measured in the same run.

The daemon spawns E engines that are PROTOCOL STAND-INS (tests/support/standin_group.py run as
the engine's interpreter; not vLLM: a reload's socket gap does not depend on what the engines
are), a round is open, and C threads call GET /v1/status without pause, each call on a new
connection. A connect that is refused (or finds no socket file) is tried again 10 ms later, as
a client's retry would, and counted. A call's wait runs from its first connect to its answer.

    python bench/reload.py --engines 2 --callers 4 --reloads 3
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.local_daemon import (  # noqa: E402  (bench/ is on sys.path when run)
    Daemon, free_port, kill_all, one_call, standin_config, standin_model, standin_python)
from vime.supervisor.client import SupervisorClient  # noqa: E402
from vime.supervisor.reexec import SOCKET_HANDOVER_ENV  # noqa: E402

STANDIN = ROOT / "tests" / "support" / "standin_group.py"
RETRY = 0.01


class Caller(threading.Thread):
    def __init__(self, sock: str):
        super().__init__(daemon=True)
        self.sock = sock
        self.halt = threading.Event()
        self.calls: list[tuple[float, float]] = []  # (first connect, answered)
        self.refused: list[float] = []  # when each refused connect happened
        self.dropped = 0  # connected, then no whole answer

    def run(self) -> None:
        while not self.halt.is_set():
            first = time.time()
            while True:
                try:
                    code, _ = one_call(self.sock, "GET", "/v1/status")
                    break
                except (ConnectionRefusedError, FileNotFoundError):
                    self.refused.append(time.time())
                except (ConnectionError, OSError, ValueError):
                    self.dropped += 1
                time.sleep(RETRY)
            if code == 200:
                self.calls.append((first, time.time()))


def ts(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def measure(handover: bool, engines: int, callers: int, reloads: int, tmp: Path) -> dict:
    tmp.mkdir()
    model = standin_model(tmp / "model")
    cfg = standin_config(
        tmp, standin_python(tmp, STANDIN),
        [{"name": f"e{i}", "model": str(model), "port": free_port(), "env": {"STANDIN_MODE_FILE": str(tmp / "mode")}}
         for i in range(engines)],
        supervisor={"log_level": "info"})
    d = Daemon(cfg, env={SOCKET_HANDOVER_ENV: "1" if handover else "0"})
    sock = str(tmp / "run" / "supervisor.sock")
    threads: list[Caller] = []
    try:
        for i in range(engines):
            d.transition(f"e{i}", "RUNNING", 60)
        SupervisorClient(sock).start_round(1)
        threads = [Caller(sock) for _ in range(callers)]
        for t in threads:
            t.start()
        windows, durations, execs = [], [], []
        for gen in range(1, reloads + 1):
            time.sleep(1.0)  # calls answered before the signal
            mark = d.mark()
            sent = time.time()
            d.proc.send_signal(signal.SIGHUP)
            up = d.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == gen,
                            120, after=mark)
            durations.append(ts(up) - sent)
            reexec = next(e for e in d.events[mark:] if e.get("event") == "supervisor.reexec")
            execs.append(ts(up) - ts(reexec))
            time.sleep(1.0)  # the calls that waited are answered
            windows.append((sent, time.time()))
    finally:
        for t in threads:
            t.halt.set()
        for t in threads:
            t.join(60)
        kill_all([d])
    waits, silent = [], []
    for lo, hi in windows:
        waits.append(max((b - a for t in threads for a, b in t.calls if lo <= b <= hi), default=0.0))
        refusals = sorted(r for t in threads for r in t.refused if lo <= r <= hi)
        silent.append(refusals[-1] - refusals[0] + RETRY if refusals else 0.0)
    return {"calls": sum(len(t.calls) for t in threads), "refused": sum(len(t.refused) for t in threads),
            "dropped": sum(t.dropped for t in threads), "wait": max(waits), "silent": max(silent),
            "reload": max(durations), "exec": max(execs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--callers", type=int, default=4)
    ap.add_argument("--reloads", type=int, default=3)
    args = ap.parse_args()
    print(f"control socket across reloads: {args.engines} engine stand-ins, {args.callers} callers without pause, "
          f"{args.reloads} reloads per row; baseline: the socket closed and bound again (no handover)")
    print(f"{'socket':>9} {'calls':>6} {'refused':>8} {'dropped':>8} {'longest wait s':>15} {'silent s':>9} "
          f"{'reload s':>9} {'exec s':>7}", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory() as t:
        for name, handover in (("rebind", False), ("handover", True)):
            try:
                r = rows[name] = measure(handover, args.engines, args.callers, args.reloads, Path(t) / name)
            except Exception as e:  # the other row still runs and prints
                print(f"{name:>9} failed: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                continue
            print(f"{name:>9} {r['calls']:>6} {r['refused']:>8} {r['dropped']:>8} {r['wait']:>15.2f} "
                  f"{r['silent']:>9.2f} {r['reload']:>9.2f} {r['exec']:>7.2f}", flush=True)
    if "rebind" in rows and "handover" in rows and rows["rebind"]["silent"] > 0:
        print(f"longest wait with the handover / the socket's silence without it: "
              f"{rows['handover']['wait'] / rows['rebind']['silent']:.2f}")
    print(f"(cpu count {os.cpu_count()}; python {sys.version.split()[0]}; the longest of each row's reloads: 'silent s' "
          f"first to last refused connect, 'reload s' SIGHUP to the new image serving (its --check-config "
          f"included), 'exec s' the exec to the new image serving)")


if __name__ == "__main__":
    main()
