"""The chaos soak: the RL loop on real engines under the daemon, a seeded schedule of faults,
fuzzed requests at the control socket all along, and exact figures at the end.

    python -m vime.harness.soak --seed 7 --long                   # the long form (every fault kind, twice)
    python -m vime.harness.soak --seed 7                          # the short form CI runs (tests/engine/test_soak_real.py)
    python -m vime.harness.soak --hours 2 --out soak-2h           # by the clock: a fault every 5 min, the
                                                                  # daemon sampled every minute (harness/growth.py)

Faults (harness/faults.py): kill -9 of an engine during a round and in a gap, SIGSTOP of an
EngineCore, an engine that crashes at start (its model path broken, then mended), a push that
fails midway, a checkpoint reload that is poisoned (no agent, a truncated checkpoint), a trainer
that disconnects mid-round, kill -9 of the daemon itself (restarted a second later, as systemd's
Restart=on-failure would), and, in the long form only, faults inside the step's broadcast (a
receiver killed -9 or SIGSTOPped, the pushing trainer process killed -9) and a forged push (one
engine gets another version's tensors, answered 200, its label set to the version: caught by
the version's fingerprint, never routed). Two more daemon restarts, in a round gap: a clean one
(SIGTERM, engines stopped, then started again: `systemctl restart`), and kill -9 with the
journal then torn (the new daemon must find and stop the old engines, start new ones, and be
told the version again by the trainer). Each waits for a whole fleet, so each is measured alone.

Checked, exactly: every round completes with every sample (none lost, none twice); no answer
came from an engine at another version than the trainer's (the daemon's listing, and vLLM's
logprobs equal to the trainer's); every engine ends RUNNING on the trainer's version; the
restarted daemon re-adopted the engines (same pids); after a clean or corrupt-journal restart
no old engine process is left and every engine is RUNNING on the trainer's version again; no
daemon crash; no fuzzed request got a 5xx; after the daemon's SIGTERM no engine process and no
engine port is left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime.harness import faults, growth
from vime.harness.chaos import ChaosHooks, ChaosLoop, ChaosReport, build_parser, format_report
from vime.harness.demo import BOOT, demo_config
from vime.harness.local_daemon import Daemon, live_pids_in_groups, one_call
from vime.harness.timeline import write_for_run
from vime.supervisor.client import SupervisorClient
from vime.supervisor.config import Config
from vime.supervisor.engine.process import port_is_free
from vime.supervisor.protocol import Cause, Event
from vime.trainer.rl_loop import quiet_rollout_log
from vime.trainer.tiny_model import build_tiny_model

# Daemon restarts in a round gap, the soak's own kinds (run as harness/faults.py's "daemon"
# kind): a clean one, and one with the journal torn after a kill -9.
GAP_RESTARTS = {"daemon-term": "SIGTERM then start (clean restart)",
                "daemon-corrupt": "kill -9, journal torn, then start"}
# The short form CI runs: the faults no other engine test makes. An engine's kill -9 (in a
# round, in a gap) and its resync are tests/engine's (engines, resync, rl_loop); each costs a boot.
# So does the clean restart (daemon-term: the long form's), whose halves are tested apart on
# real engines (SIGTERM stops every engine: test_engines_real; a start boots them).
SHORT = ["daemon", "disconnect", "crash-start", "poison-reload", "daemon-corrupt"]
# The mid-push faults (faults.MID_PUSH) run in the long form only: each costs a push's bound or
# a restart of every engine, more than CI's budget; so does the forged push (an engine's
# restart; its catch is tests/engine/test_fingerprint_real.py's in CI).
LONG = ["kill", "kill-gap", "hang", "crash-start", "push", "poison-reload", "disconnect", "daemon",
        "daemon-term", "daemon-corrupt", *faults.MID_PUSH, "forged-push"]


# The long run's kinds (--hours): those that recover without waiting minutes. Left out: the
# clean and torn-journal daemon restarts (every engine started again: a whole fleet's boot, and
# a fresh daemon's warm-up each time) and the mid-push faults (each waits out a push's bound or
# restarts every engine). The daemon's kill -9 stays: its engines are re-adopted in seconds, and
# the new daemon's own quantities are fitted apart (harness/growth.py).
HOURS = ["kill", "kill-gap", "hang", "crash-start", "push", "poison-reload", "disconnect", "daemon"]
# The long run's retention, tighter than the defaults so that hours of faults prune logs and
# post-mortems (the growth report checks every sample against them).
HOURS_RETENTION = {"log_keep": 3, "log_keep_bytes": 8 << 20, "incidents_keep": 4, "incidents_keep_bytes": 8 << 20}


def schedule(kinds: list[str], seed: int, first: int = 2, spacing: int = 2) -> list[faults.Fault]:
    """The kinds in a seeded order, one every `spacing` steps (+ seeded jitter) from `first`."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    plan, step = [], first
    for kind in order:
        plan.append(faults.Fault(kind, step))
        step += spacing + rng.randint(0, 1)
    return plan


class Keeper(ChaosHooks):
    """Owns the daemon process like systemd would (restarts it after a kill -9 or a crash) and
    the engines' model paths (symlinks it can point at a broken model)."""

    def __init__(self, root: Path, cfg: Path, links: dict[str, Path], model: Path, broken: Path):
        self.root, self.cfg, self.links, self.model, self.broken = root, cfg, links, model, broken
        self.log = open(root / "daemon.log", "a")
        self.daemons: list[Daemon] = []
        self.killed = 0
        self.restarts = 0  # gap restarts (GAP_RESTARTS)
        self.gap_restarts: list[dict[str, Any]] = []
        self.crashes = 0
        self.adoption: list[dict[str, Any]] = []  # (pid, restarts) of each engine around a daemon kill
        self.outages: list[list[Any]] = []  # [killed at, answering again at (None until then)]
        self._lock = threading.Lock()
        self._stopping = False
        self.start()
        threading.Thread(target=self._watch, daemon=True).start()

    @property
    def daemon(self) -> Daemon:
        return self.daemons[-1]

    @property
    def sock(self) -> str:
        return str(self.root / "run" / "supervisor.sock")

    def start(self) -> None:
        self.daemons.append(Daemon(self.cfg, tee=self.log))

    def _watch(self) -> None:
        """A daemon that exits without being told to is a crash: count it, restart it."""
        while not self._stopping:
            d = self.daemon
            if d.proc.poll() is not None and not self._stopping:
                with self._lock:
                    if d is self.daemon and not getattr(d, "killed_by_us", False):
                        self.crashes += 1
                        time.sleep(1.0)
                        self.start()
            time.sleep(0.2)

    def in_outage(self, t: float) -> bool:
        """Was the daemon being killed and restarted at (or just after) time t?"""
        now = time.time()
        return any(a - 1.0 <= t <= (b if b is not None else now) for a, b in self.outages)

    def kill_daemon(self) -> None:
        with self._lock:
            client = SupervisorClient(self.sock)
            before = {e["name"]: (e.get("pid"), e.get("restarts")) for e in client.status()["engines"]}
            self.outages.append([time.time(), None])
            d = self.daemon
            d.killed_by_us = True
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(10)
            self.killed += 1
            time.sleep(1.0)  # systemd's RestartSec=1
            self.start()
        after = {e["name"]: (e.get("pid"), e.get("restarts"))
                 for e in SupervisorClient(self.sock, connect_timeout=60).status()["engines"]}
        self.outages[-1][1] = time.time()
        self.adoption.append({"before": before, "after": after,
                              "same": before == after and all(pid for pid, _ in before.values())})

    def restart_daemon(self, kind: str) -> dict[str, Any]:
        """A gap restart (GAP_RESTARTS): the daemon goes, comes back, and must leave no engine
        of the old one behind. What happened, for the soak's check."""
        with self._lock:
            before = {e["name"]: e.get("pid") for e in SupervisorClient(self.sock).status()["engines"]}
            self.outages.append([time.time(), None])
            d = self.daemon
            d.killed_by_us = True
            rc = None
            if kind == "daemon-term":
                rc = d.terminate(60)  # stops its engines; the next daemon must start them again
            else:  # kill -9 leaves the engines running; then the journal is torn mid-write
                d.proc.send_signal(signal.SIGKILL)
                d.proc.wait(10)
                state_dir = Path(tomllib.loads(self.cfg.read_text())["supervisor"]["state_dir"])
                (state_dir / "journal.json").write_bytes(b'{"format": 1, "engines": {"engine-0": {"pid": \xff')
            self.restarts += 1
            time.sleep(1.0)  # systemd's RestartSec=1
            self.start()
        SupervisorClient(self.sock, connect_timeout=60).status()
        self.outages[-1][1] = time.time()
        old = {p for p in before.values() if p}
        deadline = time.time() + 30  # the new daemon stops the old groups before it starts any
        while (left := live_pids_in_groups(old)) and time.time() < deadline:
            time.sleep(0.2)
        record = {"kind": kind, "exit": rc, "before": before, "old processes left": left}
        self.gap_restarts.append(record)
        return record

    def _point(self, engine: str, target: Path) -> None:
        link = self.links[engine]
        tmp = link.with_name(link.name + ".tmp")
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(target)
        os.replace(tmp, link)

    def break_model(self, engine: str) -> None:
        self._point(engine, self.broken)

    def fix_model(self, engine: str) -> None:
        self._point(engine, self.model)

    def spawned_pids(self) -> set[int]:
        return {p for d in self.daemons for p in d.spawned_pids()}

    def terminate(self) -> int | None:
        """SIGTERM, as systemd stops it. None if it did not exit in time: then it and every
        engine group are killed, and the soak's clean-stop check fails."""
        self._stopping = True
        try:
            return self.daemon.terminate(60)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            for pid in self.spawned_pids():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            return None
        finally:
            self.log.close()


class SoakLoop(ChaosLoop):
    """The chaos loop plus the soak's gap restarts of the daemon: injected before a step's
    round (so no round loses its engines), then the fleet is waited for until whole again."""

    def __init__(self, args: argparse.Namespace, *, plan: list[faults.Fault], hooks: Keeper, gap: dict[int, str]):
        super().__init__(args, plan=plan, hooks=hooks)
        self.keeper = hooks
        self.gap = gap  # id(fault) -> its GAP_RESTARTS kind
        self.forged: list[tuple[faults.Fault, bool, str]] = []  # after the run: each forged push, caught, why

    async def before_round(self, step: int) -> None:
        fault = self.due(step)
        if fault is not None and id(fault) in self.gap and await self._ready_for(fault):
            await asyncio.to_thread(self._restart_in_gap, fault, step)
        await super().before_round(step)

    def _restart_in_gap(self, fault: faults.Fault, step: int) -> None:
        kind = self.gap[id(fault)]
        fault.fired_step, fault.injected_at = step, time.time()
        rec = self.keeper.restart_daemon(kind)
        self.log(f"FAULT {GAP_RESTARTS[kind]} of the daemon before step {step}")
        client, view = self.client, self.view
        status = client.status()
        if self.published is not None and status["weight_version"] != self.published:
            # A daemon that lost its journal lost the version too: the trainer says it again,
            # or engines on the base weights would be routed as current.
            self.log(f"the daemon has v{status['weight_version']}, not v{self.published}: publishing it again")
            client.publish_weights(self.published, fingerprint=self.fingerprint())
        whole = view.wait(lambda: view.whole(self.published), self.args.fault_wait)
        rec["whole again"] = whole
        fault.confirmed = whole and not rec["old processes left"] and rec["exit"] in (0, None)
        fault.note = (f"{GAP_RESTARTS[kind]}: exit {rec['exit']}, old pids {sorted(p for p in rec['before'].values() if p)}, "
                      f"left {rec['old processes left']}, whole again {whole}")


    # -- the forged push ---------------------------------------------------------------------

    def push_all(self, engines: list[dict[str, Any]], tensors, version: int) -> dict[str, str]:
        """A forged-push fault's engine gets another version's tensors under this version's
        label; the others the step's broadcast."""
        fault = self.fault_now("forged-push")
        victim = next((e for e in engines if fault is not None and e["name"] == fault.engine), None)
        if fault is None or victim is None:
            return super().push_all(engines, tensors, version)
        out = super().push_all([e for e in engines if e is not victim], tensors, version)
        out[victim["name"]] = self._forge(fault, victim, tensors, version)
        return out

    def _forge(self, fault: faults.Fault, engine: dict[str, Any], tensors, version: int) -> str:
        """Tensors of a version never published (the step's, each moved by FORGED_OFFSET),
        every call answered 200, the engine's label set to `version`: confirmed when the label
        check alone would pass. Not a push that sends nothing: a step whose rewards are all
        equal leaves the weights as they were, and an engine that kept them holds the version."""
        from vime.weight_sync.sender import WeightSender

        fault.fired_step, fault.injected_at = self.step_no, time.time()
        st = self._engine_status(engine["name"])
        fault.pid, fault.incarnation = st.get("pid"), st.get("incarnation")
        url = engine["url"]
        self.pusher.drop(url)
        sender = WeightSender(url, backend=self.pusher.backend)
        try:
            outcome = self.pusher.push_with(sender, url, [(n, t + FORGED_OFFSET) for n, t in tensors], version)
        finally:
            sender.close()
        label = engine_label(url)
        fault.confirmed = outcome == "ok" and label == str(version)
        fault.note = f"push of other tensors answered {outcome!r}; /weight_info says {label}"
        self.log(f"FAULT a push into {engine['name']} of tensors not v{version}'s, labelled v{version}: {fault.note}")
        return outcome

    def after_run(self) -> None:
        super().after_run()
        events = self.recorder.events
        self.forged = [(f, *forged_push_caught(f, events)) for f in self.plan if f.kind == "forged-push"]


# The forged push's tensors: the version's, each element moved by this much (far past any
# fingerprint tolerance on the tiny model).
FORGED_OFFSET = 0.05


def engine_label(url: str) -> str | None:
    """What the engine's /weight_info says (its label), None if it does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/weight_info", timeout=10) as r:
            return str(json.loads(r.read())["weight_version"])
    except (OSError, ValueError, KeyError):
        return None


def forged_push_caught(fault: faults.Fault, events: list[dict[str, Any]]) -> tuple[bool, str]:
    """A forged push is caught when the daemon condemned its engine for its fingerprint, and no
    membership listed the engine routable from the forged version's publish until it ran
    again on verified weights (faults.timeline's resynced_at)."""
    if fault.injected_at is None or fault.engine is None:
        return False, f"not injected ({fault.note or 'no step came for it'})"
    after = [ev for ev in events if ev.get("ts", 0) >= fault.injected_at]
    published = next((ev["ts"] for ev in after if ev.get("event") == Event.WEIGHTS_PUBLISHED), None)
    if published is None:
        return False, "the forged version was never published"
    until = fault.resynced_at if fault.resynced_at is not None else float("inf")
    routed = [round(ev["ts"] - fault.injected_at, 3) for ev in after
              if ev.get("event") == Event.MEMBERSHIP and published <= ev["ts"] < until
              and fault.engine in ev.get("routable", [])]
    caught = fault.detected_cause == Cause.FINGERPRINT
    ok = caught and not routed and fault.resynced_at is not None
    return ok, (f"{fault.engine}: detected as {fault.detected_cause!r}, listed routable at {routed} s after the "
                f"forgery, verified again after {fault.after(fault.resynced_at)} s")


class Fuzzer:
    """Bad requests at the control socket, all through the run (seeded): each must be refused
    with a 4xx and change nothing. Connections refused while the daemon restarts are counted
    apart."""

    def __init__(self, sock: str, seed: int, engines: list[str], keeper: Keeper, rate: float = 20.0):
        self.sock, self.rng, self.engines, self.rate = sock, random.Random(seed), engines, rate
        self.keeper = keeper
        self.sent = self.refused_4xx = self.server_errors = self.unreachable = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def request(self) -> tuple[str, str, bytes]:
        r, e = self.rng, self.rng.choice(self.engines)
        return r.choice([
            ("POST", "/v1/weights", r.choice([b"{", b"[]", b'{"version": "x"}', b'{"version": -1}',
                                              b'{"version": 1, "checkpoint": "/no/such/dir"}',
                                              b'{"version": 1.5}', b'{"nope": 1}', bytes(r.randbytes(40))])),
            ("POST", f"/v1/rounds/{r.choice(['abc', '-1', '1e3', ''])}/start", b""),
            ("POST", f"/v1/rounds/{r.randint(-5, 0)}/end", b""),
            ("POST", f"/v1/engines/{r.choice(['nope', 'engine-99', '..'])}/restart", b""),
            ("POST", f"/v1/engines/{e}/{r.choice(['explode', 'sync', 'logs'])}", b""),
            ("POST", f"/v1/engines/{e}/failures", r.choice([b'{"detail": 5}', b'{"poisoned": "yes"}', b"{"])),
            ("POST", f"/v1/engines/{e}/sync/begin", b'{"version": "v"}'),
            ("GET", f"/v1/{r.choice(['nope', 'statuss', 'engines'])}", b""),
            ("DELETE", "/v1/status", b""),
            ("POST", "/v1/weights", b"{" + b" " * (70 * 1024)),
        ])

    def _one(self) -> None:
        method, path, body = self.request()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        t0 = time.time()
        try:
            s.connect(self.sock)
        except (ConnectionRefusedError, FileNotFoundError):  # the daemon is restarting
            self.unreachable += 1
            s.close()
            return
        data = b""
        try:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            while chunk := s.recv(65536):
                data += chunk
        except OSError as e:
            if not data and self.keeper.in_outage(t0):
                self.unreachable += 1  # the daemon was killed under this request
                return
            data = data or f"{type(e).__name__}: {e}".encode()
        finally:
            s.close()
        if not data and self.keeper.in_outage(t0):
            self.unreachable += 1
            return
        self.sent += 1
        try:
            code = int(data.split(b" ", 2)[1])
        except (IndexError, ValueError):
            code = 0
        if 400 <= code < 500:
            self.refused_4xx += 1
        else:
            self.server_errors += code >= 500
            self.errors.append(f"{method} {path} -> {data[:200]!r}")

    def _run(self) -> None:
        while not self._stop.wait(1.0 / self.rate):
            self._one()

    def start(self) -> "Fuzzer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


class HoursLoop(SoakLoop):
    """The soak by the clock (--hours): a fault `fault_every` seconds after the last one was
    injected (the first after `fault_every` from the start), its kind the next of a seeded
    order of `kinds`, shuffled again each time round; the run ends at the first step after
    `until` (time.time()). A fault due but not yet injected is injected first (postponed ones
    included); none is made after `until`."""

    def __init__(self, args: argparse.Namespace, *, hooks: Keeper, kinds: list[str], seed: int,
                 fault_every: float, start: float, until: float, plan: list[faults.Fault]):
        super().__init__(args, plan=plan, hooks=hooks, gap={})
        self.kinds, self.rng = kinds, random.Random(seed)
        self.fault_every, self.start, self.until = fault_every, start, until
        self.order: list[str] = []

    def due(self, step: int) -> faults.Fault | None:
        pending = next((f for f in self.plan if f.fired_step is None), None)
        if pending is not None:
            return pending
        last = max((f.injected_at for f in self.plan if f.injected_at is not None), default=self.start)
        now = time.time()
        if now >= self.until or now < last + self.fault_every or not self.kinds:
            return None
        if not self.order:
            self.order = list(self.kinds)
            self.rng.shuffle(self.order)
        fault = faults.Fault(self.order.pop(0), step)
        if fault.kind in GAP_RESTARTS:  # run as the "daemon" kind by SoakLoop
            self.gap[id(fault)], fault.kind = fault.kind, "daemon"
        self.plan.append(fault)
        return fault

    def enough(self, step: int) -> bool:
        return time.time() >= self.until


TRIP_GAP_S = 0.5  # between the five status round trips of one sample


class Sampler:
    """Every `every` seconds, one line of samples.jsonl: the daemon's RSS, open descriptors,
    threads and event-loop lag, the journal's size, the log volume, the engines' RSS.

    The daemon has no loop-lag probe: the lag's proxy is the round trip of `GET /v1/status`
    (the least of five, half a second apart, no retry), which waits for the loop like every
    request does. The daemon's pid and start come from that answer (`daemon.pid`,
    `daemon.uptime`), so a restarted daemon is followed and marked (`daemon_restarted`); while
    it does not answer, the harness's own child is read and the lag is missing."""

    def __init__(self, root: Path, cfg: Path, keeper: Keeper, every: float, plan: list[faults.Fault]):
        sup = tomllib.loads(cfg.read_text())["supervisor"]
        self.root, self.keeper, self.every, self.plan = root, keeper, every, plan
        self.state_dir, self.log_dir = Path(sup["state_dir"]), Path(sup["log_dir"])
        self.path = root / "samples.jsonl"
        self.samples: list[dict[str, Any]] = []
        self.start = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start_now(self) -> Sampler:
        self.start = time.time()
        self.path.write_text("")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        with self.path.open("a") as out:
            while True:
                try:
                    sample = self.take()
                except Exception as e:  # noqa: BLE001 - a sample lost is a gap, not the run's end
                    sample = {"t": time.time() - self.start, "error": f"{type(e).__name__}: {e}"}
                self.samples.append(sample)
                out.write(json.dumps(sample) + "\n")
                out.flush()
                if self._stop.wait(self.every):
                    return

    def _status(self) -> tuple[dict[str, Any] | None, float | None]:
        trips, status = [], None
        for k in range(5):
            if k:
                time.sleep(TRIP_GAP_S)
            t0 = time.monotonic()
            try:
                code, body = one_call(self.keeper.sock, "GET", "/v1/status", timeout=10)
            except OSError:
                continue
            if code == 200:
                trips.append(time.monotonic() - t0)
                status = body
        # The least of five, spread over two seconds: what the loop itself adds, less the
        # harness's own scheduling on a shared host (a booting engine slowed the median of three
        # by 250 ms/h in a 12-min run) and less a burst of the daemon's own work (a round's
        # start, a fault) that five back-to-back trips all fall into.
        return status, (min(trips) * 1000 if trips else None)

    def take(self) -> dict[str, Any]:
        now = time.time()
        t = now - self.start
        status, lag = self._status()
        prev = next((s for s in reversed(self.samples) if s.get("daemon_pid")), None)
        if status is not None:
            pid = status["daemon"]["pid"]
            started = now - status["daemon"]["uptime"] - self.start
        else:
            pid = self.keeper.daemon.proc.pid
            started = prev["daemon_started"] if prev and prev["daemon_pid"] == pid else t
        s: dict[str, Any] = {"t": round(t, 2), "daemon_pid": pid, "daemon_started": round(started, 2),
                             "daemon_restarted": prev is not None and prev["daemon_pid"] != pid,
                             "daemon_answered": status is not None, "loop_lag_ms": lag,
                             "faults_injected": sum(f.injected_at is not None for f in list(self.plan))}
        s.update(proc_sample(pid, reads=FD_READS))
        engines = [e["pid"] for e in (status or {}).get("engines", []) if e.get("pid")]
        s["engines_rss"] = group_rss(engines) if status is not None else None
        journal = self.state_dir / "journal.json"
        s["journal_bytes"] = journal.stat().st_size if journal.exists() else 0
        daemon_log = self.root / "daemon.log"
        s["daemon_log_bytes"] = daemon_log.stat().st_size if daemon_log.exists() else 0
        s.update(log_dir_sample(self.log_dir))
        s["log_bytes"] = s["daemon_log_bytes"] + s["engine_logs_bytes"] + s["incidents_bytes"]
        return s


TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"  # /proc/net/tcp's st column


def outbound_connections(pid: int, fds: list[str] | None = None) -> tuple[set[str], dict[str, int]]:
    """The process's open TCP connections that it made itself and that are live: the inodes of
    its sockets in ESTABLISHED state from a local port it does not listen on (its HTTP clients'
    pooled connections; an accepted one has the listener's port), and their count per peer
    (address:port, hex as /proc writes it). `fds`: the names in /proc/PID/fd, if listed already."""
    rows: list[list[str]] = []
    for table in ("tcp", "tcp6"):
        try:
            rows += [line.split() for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]]
        except OSError:
            continue
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd") if fds is None else fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while listed
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    rows = [f for f in rows if len(f) >= 10 and f[9] in inodes]
    listening = {f[1].rpartition(":")[2] for f in rows if f[3] == TCP_LISTEN}
    mine = {f[9]: f[2] for f in rows if f[3] == TCP_ESTABLISHED and f[1].rpartition(":")[2] not in listening}
    return set(mine), Counter(mine.values())


FD_READS, FD_GAP_S = 3, 0.25  # the judged descriptors: the least of three reads this far apart


def least_fds(reads: list[dict[str, Any]]) -> dict[str, Any]:
    """One sample from several reads of proc_sample: the first read's figures, with `daemon_fds`
    the least of the reads' and `daemon_fds_max` the most. A leaked descriptor is open at every
    read; one the daemon holds for a moment (a connection being made, a spawned engine's pipes,
    a file being written) is missing from one read at least. A read of a process gone is None."""
    first = dict(reads[0])
    judged = [r["daemon_fds"] for r in reads if r.get("daemon_fds") is not None]
    first["daemon_fds"] = min(judged, default=None)
    first["daemon_fds_max"] = max(judged, default=None)
    return first


def proc_sample(pid: int, reads: int = 1, gap: float = FD_GAP_S) -> dict[str, Any]:
    """A process's RSS (bytes), open descriptors and threads, from /proc (None if it is gone).

    `daemon_fds` leaves out the live outbound TCP connections (the HTTP clients' pools: one or
    two per engine, opened and closed with the probes' phase, 560 to 830 for 256 engines), so
    that its slope reads leaks, not traffic; a leaked connection still counts once its peer has
    closed it (CLOSE_WAIT). The whole count and the pools' are reported beside it. With `reads`
    above 1, the descriptors are read that many times `gap` seconds apart (least_fds)."""
    if reads > 1:
        samples = [proc_sample(pid)]
        for _ in range(reads - 1):
            time.sleep(gap)
            samples.append(proc_sample(pid))
        return least_fds(samples)
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        fds = os.listdir(f"/proc/{pid}/fd")
        total = len(fds)
        pooled, per_peer = outbound_connections(pid, fds)
        return {"daemon_rss": int(fields["VmRSS"].split()[0]) * 1024, "daemon_threads": int(fields["Threads"]),
                "daemon_fds": total - len(pooled), "daemon_fds_all": total, "daemon_tcp_out": len(pooled),
                "daemon_tcp_out_per_peer_max": max(per_peer.values(), default=0)}
    except (OSError, KeyError, ValueError):
        return {"daemon_rss": None, "daemon_threads": None, "daemon_fds": None, "daemon_fds_all": None,
                "daemon_tcp_out": None, "daemon_tcp_out_per_peer_max": None}


def group_rss(pgids: list[int]) -> int:
    """The RSS (bytes) of every process in these process groups (each engine's server and its
    EngineCore: the daemon starts each engine in a group of its own)."""
    groups, total, page = set(pgids), 0, os.sysconf("SC_PAGE_SIZE")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            if int(stat.rpartition(")")[2].split()[2]) in groups:  # pgrp, after the comm
                total += int(Path(f"/proc/{entry.name}/statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def log_dir_sample(log_dir: Path) -> dict[str, Any]:
    """The engines' logs (`<engine>.<incarnation>.log`) and post-mortems (`incidents/`): bytes,
    and what the retention rules bound (files per engine, all but the live log's bytes)."""
    logs: dict[str, list[tuple[int, int]]] = {}
    for p in (log_dir.glob("*.log") if log_dir.is_dir() else []):
        name, _, inc = p.stem.rpartition(".")
        if inc.isdigit():
            try:
                logs.setdefault(name, []).append((int(inc), p.stat().st_size))
            except OSError:
                continue
    incidents = log_dir / "incidents"
    dirs = [d for d in incidents.iterdir() if d.is_dir()] if incidents.is_dir() else []
    inc_bytes = 0
    for d in dirs:
        for f in d.rglob("*"):
            try:
                inc_bytes += f.stat().st_size if f.is_file() else 0
            except OSError:
                continue
    return {"engine_logs_bytes": sum(b for v in logs.values() for _, b in v),
            "engine_log_files_max": max((len(v) for v in logs.values()), default=0),
            "engine_old_logs_bytes_max": max((sum(b for _, b in sorted(v)[:-1]) for v in logs.values()), default=0),
            "incident_dirs": len(dirs), "incidents_bytes": inc_bytes}


def retention_limits(cfg: Path) -> dict[str, int]:
    sup = tomllib.loads(cfg.read_text()).get("supervisor", {})
    return {k: int(sup.get(k, getattr(Config, k))) for _, k, _ in growth.RETENTION}


@dataclass
class Hours:
    """The long run's pace (--hours)."""
    hours: float
    fault_every: float = 300.0  # seconds
    sample_every: float = 60.0
    warmup: float | None = None  # seconds; default growth.warmup_for(the run)


@dataclass
class SoakResult:
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    growth: dict[str, Any] | None = None  # the growth report of a run by the clock (--hours)

    @property
    def ok(self) -> bool:
        return all(ok for ok, _ in self.checks.values())

    def format(self) -> str:
        lines = ["", "soak figures"] + [f"  {k:<34}{v}" for k, v in self.figures.items()]
        lines += ["", "checks"] + [f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}" for name, (ok, detail)
                                   in self.checks.items()]
        return "\n".join(lines)


def soak_config(root: Path, model: Path, engines: int, hours: Hours | None) -> tuple[Path, dict[str, Path], Path]:
    """The run's folder: a broken model (crash-start's), a link per engine to the model (so a
    fault can break one engine's path alone), and the daemon's config. (config, links, broken)."""
    broken = root / "broken-model"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"}')
    links = {n: root / "models" / n for n in (f"engine-{i}" for i in range(engines))}
    for n, link in links.items():
        link.parent.mkdir(exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(model)
    cfg = demo_config(
        root, model, engines=engines, models=links,
        # Probe timeout 3 s: a loaded 2-core machine must not make a busy engine look hung.
        interval=1.0, timeout=3.0, threshold=2,
        # The schedule restarts engines on purpose, every minute or so: not flapping.
        restart={"start_retries": 5, "backoff_initial": 1.0, "backoff_max": 5.0, "flapping_max_restarts": 1000},
        supervisor=HOURS_RETENTION if hours else None)
    return cfg, links, broken


def gap_restarts_as_daemon(plan: list[faults.Fault]) -> dict[int, str]:
    """The gap restarts run as harness/faults.py's "daemon" kind, by SoakLoop: each such
    fault's kind becomes "daemon"; {id(fault): its soak kind}."""
    gap = {}
    for fault in plan:
        if fault.kind in GAP_RESTARTS:
            gap[id(fault)], fault.kind = fault.kind, "daemon"
    return gap


def run_by_the_clock(args: argparse.Namespace, keeper: Keeper, sampler: Sampler, kinds: list[str], seed: int,
                     hours: Hours, plan: list[faults.Fault]) -> tuple[ChaosReport, dict[int, str]]:
    """HoursLoop until the clock runs out; (its report, its gap restarts). `plan` ends as the
    faults injected: one made but not injected when the clock ran out (postponed at the end)
    is dropped."""
    loop = HoursLoop(args, hooks=keeper, kinds=kinds, seed=seed, fault_every=hours.fault_every,
                     start=sampler.start, until=sampler.start + hours.hours * 3600, plan=plan)
    report = loop.run()
    late = [f for f in plan if f.injected_at is None]
    plan[:] = [f for f in plan if f.injected_at is not None]
    if late:
        print(f"faults due when the run ended, not injected: {[f.kind for f in late]}")
    return report, loop.gap


def write_growth(root: Path, cfg: Path, sampler: Sampler, hours: Hours | None) -> dict[str, Any]:
    """The growth report of the samples taken (harness/growth.py), written to growth.json."""
    rep = growth.report(
        sampler.samples, limits=retention_limits(cfg), start=0.0,
        warmup_s=hours.warmup if hours and hours.warmup is not None
        else growth.warmup_for(sampler.samples[-1]["t"] if sampler.samples else 0.0))
    (root / "growth.json").write_text(json.dumps(rep, indent=1, default=str))
    return rep


@dataclass
class Stopped:
    """The daemon's SIGTERM at the end: its exit status, what was left of its engines."""
    rc: int | None
    left: list[tuple[int, int, str]]  # (pid, pgid, comm)
    ports_left: list[int]


def stop_keeper(keeper: Keeper, ports: dict[str, int]) -> Stopped:
    pids = keeper.spawned_pids()
    rc = keeper.terminate()
    return Stopped(rc, live_pids_in_groups(pids), [p for p in ports.values() if not port_is_free("127.0.0.1", p)])


def forged_checks(forged: list[tuple[faults.Fault, bool, str]]) -> dict[str, tuple[bool, str]]:
    """The forged pushes (the long form): each caught by the fingerprint, never routed."""
    if not forged:
        return {}
    missed = [why for _, ok, why in forged if not ok]
    return {"every forged push caught, never routed": (
        not missed, "; ".join(missed) or f"{len(forged)} caught: " + "; ".join(why for _, _, why in forged))}


def round_checks(report: ChaosReport, steps: int, plan: list[faults.Fault]) -> dict[str, tuple[bool, str]]:
    """What the rounds and the faults must show: every sample, once, at the trainer's version."""
    c = {}
    expected = 2 * 4
    steps_done = [s for s in report.steps if not s.lost]
    c["every round completed"] = (report.rounds_lost == 0 and len(steps_done) == steps,
                                  f"{len(steps_done)}/{steps} steps, {report.rounds_lost} rounds lost")
    short = [s.step for s in report.steps if s.samples != expected]
    dup = sum(s.duplicates for s in report.steps)
    # One answer per logical request is the rollout client's contract: every prompt of
    # every round answered, and no request id twice among the samples trained on.
    c["no request lost or served twice"] = (not short and dup == 0,
                                            f"steps short of {expected} samples: {short}; "
                                            f"request ids seen twice: {dup}")
    gaps = [s.logprob_gap_max for s in report.steps if s.logprob_gap_max is not None]
    c["no stale response"] = (report.stale_responses == 0 and len(gaps) == steps and max(gaps) < 1e-3,
                              f"{report.stale_responses} listed at another version; max |vLLM - trainer| "
                              f"logprob {max(gaps) if gaps else float('nan'):.1e}")
    ends = {n: (e["state"], e["weight_version"]) for n, e in report.engines.items()}
    c["engines end RUNNING on the trainer's version"] = (
        all(st == "RUNNING" and v == report.final_version for st, v in ends.values()),
        f"trainer v{report.final_version}; {ends}")
    missing = [f"{f.kind}: {f.wrong_cause() or f.note or 'not recovered'}" for f in report.faults
               if f.injected_at is None or f.resynced_at is None or f.confirmed is False
               or (f.kind in faults.MUST_CONFIRM and not f.confirmed)
               or f.wrong_cause()]
    c["every fault injected, detected, recovered"] = (not missing, "; ".join(missing) or f"{len(plan)} faults")
    return c


def daemon_checks(keeper: Keeper, gap: dict[int, str], growth_rep: dict[str, Any] | None,
                  fuzzer: Fuzzer | None, stopped: Stopped) -> dict[str, tuple[bool, str]]:
    """What the daemon must show: engines re-adopted, whole again after a gap restart, no
    crash, nothing grown past its bound, no 5xx to a fuzzed request, a clean stop."""
    c = {}
    if keeper.adoption:
        c["the restarted daemon re-adopted its engines"] = (all(a["same"] for a in keeper.adoption),
                                                            f"(pid, restarts) before/after: {keeper.adoption}")
    if gap:
        bad = [r for r in keeper.gap_restarts if r["old processes left"] or r["exit"] not in (0, None)
               or not r.get("whole again")]
        c["clean and corrupt-journal restarts: old engines gone, fleet whole again"] = (
            len(keeper.gap_restarts) == len(gap) and not bad,
            f"{len(keeper.gap_restarts)}/{len(gap)} done; failed: {bad}" if bad or len(keeper.gap_restarts) != len(gap)
            else f"{len(gap)} restarts, exit 0 (clean), no old process left, every engine RUNNING on the trainer's version")
    c["no daemon crash"] = (keeper.crashes == 0, f"{keeper.crashes} unexpected exits")
    if growth_rep is not None:
        grew = [f"{r['label']}: {r['verdict']}" for r in growth_rep["quantities"] if not r["ok"]]
        grew += [f"{r['rule']}: max {r['max seen']} > {r['limit']}" for r in growth_rep["retention"] if not r["ok"]]
        c["nothing grows beyond its bound (growth.json)"] = (
            growth_rep["ok"], "; ".join(grew) or f"{len(growth_rep['quantities'])} quantities, "
                                                f"{growth_rep['samples']} samples; retention kept")
    if fuzzer is not None:
        c["no fuzzed request got a 5xx or no answer"] = (
            fuzzer.sent > 0 and fuzzer.server_errors == 0 and not fuzzer.errors,
            "; ".join(fuzzer.errors[:3]) or f"{fuzzer.sent} sent, all refused with a 4xx")
    c["clean stop: exit 0, no process, no port"] = (
        stopped.rc == 0 and not stopped.left and not stopped.ports_left,
        f"exit {stopped.rc}; processes {stopped.left}; ports {stopped.ports_left}")
    return c


def soak_figures(*, seed: int, steps: int, plan: list[faults.Fault], report: ChaosReport | None, fuzzer: Fuzzer | None,
                 keeper: Keeper, seconds: float, hours: Hours | None, gap: dict[int, str],
                 forged: list[tuple[faults.Fault, bool, str]] | None = None) -> dict[str, Any]:
    f: dict[str, Any] = {}
    f["seed"] = seed
    f["steps (rounds)"] = steps
    f["faults injected"] = sum(x.injected_at is not None for x in plan)
    f["faults survived (recovered)"] = sum(x.resynced_at is not None for x in plan)
    f["rounds lost"] = report.rounds_lost if report else "n/a"
    f["stale responses"] = report.stale_responses if report else "n/a"
    f["requests answered"] = sum(s.samples for s in report.steps) if report else 0
    f["requests re-sent"] = sum(s.resent for s in report.steps) if report else 0
    # Output tokens streamed before a fault cut them: kept in continued samples, or thrown
    # away (the request started over: regenerated). Goal: 0 regenerated.
    f["tokens cut / reused / regenerated"] = " / ".join(
        str(sum(getattr(s, k) for s in report.steps) if report else 0)
        for k in ("tokens_cut", "tokens_reused", "tokens_regenerated"))
    f["fuzzed requests (all 4xx)"] = f"{fuzzer.sent} ({fuzzer.refused_4xx})" if fuzzer else 0
    f["fuzz: daemon unreachable"] = fuzzer.unreachable if fuzzer else 0
    f["daemon kills / crashes"] = f"{keeper.killed} / {keeper.crashes}"
    f["daemon gap restarts (clean, torn)"] = keeper.restarts
    if forged:
        f["forged pushes caught (never routed)"] = f"{sum(ok for _, ok, _ in forged)}/{len(forged)}"
    f["seconds"] = round(seconds)
    if hours is not None:
        f["pace (h, fault every, sample)"] = f"{hours.hours:g} h, {hours.fault_every:g} s, {hours.sample_every:g} s"
        f["faults by kind"] = dict(sorted(Counter(gap.get(id(x), x.kind) for x in plan).items()))
    return f


def run_soak(root: Path, *, seed: int, steps: int, kinds: list[str], engines: int = 2,
             model: Path | None = None, hours: Hours | None = None) -> SoakResult:
    """The soak. With `hours`, by the clock (HoursLoop, Sampler): `steps` is ignored, and the
    growth report (harness/growth.py) is written (samples.jsonl, growth.json) and checked."""
    quiet_rollout_log()
    started = time.time()  # daemon.log is appended to: the picture shows this run's part
    root.mkdir(parents=True, exist_ok=True)
    model = model or build_tiny_model(root / "model")
    cfg, links, broken = soak_config(root, model, engines, hours)
    names = list(links)
    ports = {e["name"]: e["port"] for e in tomllib.loads(cfg.read_text())["engines"]}
    keeper = Keeper(root, cfg, links, model, broken)
    plan = schedule(kinds, seed) if hours is None else []
    gap = gap_restarts_as_daemon(plan)
    steps = max(steps, plan[-1].step + 2 if plan else steps)  # the last fault has rounds after it
    result = SoakResult()
    fuzzer = sampler = loop = None
    report = None
    growth_rep = None
    t0 = time.monotonic()
    try:
        for n in names:
            keeper.daemon.transition(n, "RUNNING", BOOT)
        fuzzer = Fuzzer(keeper.sock, seed, names, keeper).start()
        args = build_parser().parse_args([
            "--model", str(model), "--socket", keeper.sock, "--out", str(root / "out"),
            "--num-rollout", str(steps if hours is None else 10**9), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--fault-wait", str(BOOT), "--final-wait", str(BOOT), "--seed", str(seed)])
        if hours is None:
            loop = SoakLoop(args, plan=plan, hooks=keeper, gap=gap)
            report = loop.run()
        else:
            sampler = Sampler(root, cfg, keeper, hours.sample_every, plan).start_now()
            report, gap = run_by_the_clock(args, keeper, sampler, kinds, seed, hours, plan)
            steps = len(report.steps)
        print(format_report(report))
    finally:
        if fuzzer is not None:
            fuzzer.stop()
        if sampler is not None:
            sampler.stop()  # before the daemon stops: no sample of a stopping daemon
            growth_rep = write_growth(root, cfg, sampler, hours)
        stopped = stop_keeper(keeper, ports)
        if report is None:  # the run broke off: its picture now, before the error goes up
            write_for_run(root, since=started)
    if report is not None:
        result.checks.update(round_checks(report, steps, plan))
        result.checks.update(forged_checks(loop.forged if loop is not None else []))
    result.checks.update(daemon_checks(keeper, gap, growth_rep, fuzzer, stopped))
    result.figures.update(soak_figures(seed=seed, steps=steps, plan=plan, report=report, fuzzer=fuzzer,
                                       keeper=keeper, seconds=time.monotonic() - t0, hours=hours, gap=gap,
                                       forged=loop.forged if loop is not None else None))
    result.growth = growth_rep
    c, f = result.checks, result.figures
    (root / "soak.json").write_text(json.dumps({"checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in c.items()},
                                                "figures": f, "faults": [x.as_dict() for x in plan]},
                                               indent=1, default=str))
    write_for_run(root, since=started)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vime.harness.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("soak-run"))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--steps", type=int, default=None, help="rounds (default: 12 short, 40 long)")
    ap.add_argument("--model", type=Path, default=None, metavar="DIR",
                    help="the tiny model (built there if empty; default $VIME_TINY_MODEL_CACHE, else under --out)")
    ap.add_argument("--long", action="store_true", help="every fault kind, twice (else the short CI set)")
    ap.add_argument("--kinds", nargs="*", choices=[*faults.KINDS, *GAP_RESTARTS],
                    help="the faults to schedule (overrides --long and the --hours set)")
    g = ap.add_argument_group("the long run, by the clock (harness/growth.py reports and judges it)")
    g.add_argument("--hours", type=float, default=None, metavar="H",
                   help=f"run H hours (--steps and --long ignored); faults of the kinds {' '.join(HOURS)}")
    g.add_argument("--fault-every", type=float, default=5.0, metavar="MIN",
                   help="minutes from one fault's injection to the next fault (default 5)")
    g.add_argument("--sample-every", type=float, default=60.0, metavar="S",
                   help="seconds between samples of the daemon (default 60)")
    g.add_argument("--warmup", type=float, default=None, metavar="MIN",
                   help=f"minutes skipped before fitting slopes (default: {growth.WARMUP_S / 60:g}, or the "
                        f"first {growth.WARMUP_SHARE * 100:.0f}%% of a shorter run)")
    args = ap.parse_args(argv)
    if args.hours is not None and (args.hours <= 0 or args.fault_every <= 0 or args.sample_every <= 0):
        ap.error("--hours, --fault-every and --sample-every must be > 0")
    hours = None if args.hours is None else Hours(
        args.hours, args.fault_every * 60, args.sample_every, None if args.warmup is None else args.warmup * 60)
    kinds = args.kinds or (HOURS if hours else LONG * 2 if args.long else SHORT)
    steps = args.steps or (40 if args.long else 12)
    cache = args.model or os.environ.get("VIME_TINY_MODEL_CACHE")
    model = build_tiny_model(Path(cache)) if cache else None
    result = run_soak(args.out.resolve(), seed=args.seed, steps=steps, kinds=kinds, hours=hours, model=model)
    print(result.format())
    if result.growth is not None:
        print(growth.format_report(result.growth))
        print(f"\nsamples: {args.out / 'samples.jsonl'}; report: {args.out / 'growth.json'}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
