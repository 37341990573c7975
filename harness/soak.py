"""The chaos soak: the RL loop on real engines under the daemon, a seeded schedule of faults,
fuzzed requests at the control socket all along, and exact figures at the end.

    python -m vime.harness.soak --seed 7 --long                   # the long form (every fault kind, twice)
    python -m vime.harness.soak --seed 7                          # the short form CI runs (tests/engine/test_soak_real.py)

Faults (harness/faults.py): kill -9 of an engine during a round and in a gap, SIGSTOP of an
EngineCore, an engine that crashes at start (its model path broken, then mended), a push that
fails midway, a checkpoint reload that is poisoned (no agent, a truncated checkpoint), a trainer
that disconnects mid-round, kill -9 of the daemon itself (restarted a second later, as systemd's
Restart=on-failure would), and, in the long form only, faults inside the step's broadcast (a
receiver killed -9 or SIGSTOPped, the pushing trainer process killed -9). Two more daemon restarts, in a round gap: a clean one
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime.harness import faults
from vime.harness.chaos import ChaosHooks, ChaosLoop, build_parser, format_report
from vime.harness.demo import BOOT, demo_config
from vime.harness.local_daemon import Daemon, live_pids_in_groups
from vime.harness.timeline import write_for_run
from vime.supervisor.client import SupervisorClient
from vime.supervisor.engine.process import port_is_free
from vime.trainer.rl_loop import quiet_rollout_log
from vime.trainer.tiny_model import build_tiny_model

# Daemon restarts in a round gap, the soak's own kinds (run as harness/faults.py's "daemon"
# kind): a clean one, and one with the journal torn after a kill -9.
GAP_RESTARTS = {"daemon-term": "SIGTERM then start (clean restart)",
                "daemon-corrupt": "kill -9, journal torn, then start"}
SHORT = ["kill-gap", "daemon", "disconnect", "crash-start", "poison-reload", "daemon-term", "daemon-corrupt"]
# The mid-push faults (faults.MID_PUSH) run in the long form only: each costs a push's bound or
# a restart of every engine, more than CI's budget.
LONG = ["kill", "kill-gap", "hang", "crash-start", "push", "poison-reload", "disconnect", "daemon",
        "daemon-term", "daemon-corrupt", *faults.MID_PUSH]


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
            client.publish_weights(self.published)
        whole = view.wait(lambda: view.whole(self.published), self.args.fault_wait)
        rec["whole again"] = whole
        fault.confirmed = whole and not rec["old processes left"] and rec["exit"] in (0, None)
        fault.note = (f"{GAP_RESTARTS[kind]}: exit {rec['exit']}, old pids {sorted(p for p in rec['before'].values() if p)}, "
                      f"left {rec['old processes left']}, whole again {whole}")


class Fuzzer:
    """Bad requests at the control socket, all through the run (seeded): each must be refused
    with a 4xx and change nothing. Connections refused while the daemon restarts are counted
    apart."""

    def __init__(self, sock: str, seed: int, engines: list[str], keeper: "Keeper", rate: float = 20.0):
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


@dataclass
class SoakResult:
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(ok for ok, _ in self.checks.values())

    def format(self) -> str:
        lines = ["", "soak figures"] + [f"  {k:<34}{v}" for k, v in self.figures.items()]
        lines += ["", "checks"] + [f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}" for name, (ok, detail)
                                   in self.checks.items()]
        return "\n".join(lines)


def run_soak(root: Path, *, seed: int, steps: int, kinds: list[str], engines: int = 2,
             model: Path | None = None) -> SoakResult:
    quiet_rollout_log()
    started = time.time()  # daemon.log is appended to: the picture shows this run's part
    root.mkdir(parents=True, exist_ok=True)
    model = model or build_tiny_model(root / "model")
    broken = root / "broken-model"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"}')
    names = [f"engine-{i}" for i in range(engines)]
    links = {n: root / "models" / n for n in names}
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
        restart={"start_retries": 5, "backoff_initial": 1.0, "backoff_max": 5.0, "flapping_max_restarts": 1000})
    ports = {e["name"]: e["port"] for e in tomllib.loads(cfg.read_text())["engines"]}
    keeper = Keeper(root, cfg, links, model, broken)
    plan = schedule(kinds, seed)
    gap = {}
    for fault in plan:  # the gap restarts run as harness/faults.py's "daemon" kind, by SoakLoop
        if fault.kind in GAP_RESTARTS:
            gap[id(fault)], fault.kind = fault.kind, "daemon"
    steps = max(steps, plan[-1].step + 2 if plan else steps)  # the last fault has rounds after it
    result = SoakResult()
    fuzzer = None
    report = None
    t0 = time.monotonic()
    try:
        for n in names:
            keeper.daemon.transition(n, "RUNNING", BOOT)
        fuzzer = Fuzzer(keeper.sock, seed, names, keeper).start()
        args = build_parser().parse_args([
            "--model", str(model), "--socket", keeper.sock, "--out", str(root / "out"),
            "--num-rollout", str(steps), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--fault-wait", str(BOOT), "--final-wait", str(BOOT), "--seed", str(seed)])
        report = SoakLoop(args, plan=plan, hooks=keeper, gap=gap).run()
        print(format_report(report))
    finally:
        if fuzzer is not None:
            fuzzer.stop()
        pids = keeper.spawned_pids()
        rc = keeper.terminate()
        left = live_pids_in_groups(pids)
        ports_left = [p for p in ports.values() if not port_is_free("127.0.0.1", p)]
        if report is None:  # the run broke off: its picture now, before the error goes up
            write_for_run(root, since=started)
    expected = 2 * 4
    c = result.checks
    if report is not None:
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
    if fuzzer is not None:
        c["no fuzzed request got a 5xx or no answer"] = (
            fuzzer.sent > 0 and fuzzer.server_errors == 0 and not fuzzer.errors,
            "; ".join(fuzzer.errors[:3]) or f"{fuzzer.sent} sent, all refused with a 4xx")
    c["clean stop: exit 0, no process, no port"] = (rc == 0 and not left and not ports_left,
                                                    f"exit {rc}; processes {left}; ports {ports_left}")
    f = result.figures
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
    f["seconds"] = round(time.monotonic() - t0)
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
    ap.add_argument("--long", action="store_true", help="every fault kind, twice (else the short CI set)")
    ap.add_argument("--kinds", nargs="*", choices=[*faults.KINDS, *GAP_RESTARTS],
                    help="the faults to schedule (overrides --long)")
    args = ap.parse_args(argv)
    kinds = args.kinds or (LONG * 2 if args.long else SHORT)
    steps = args.steps or (40 if args.long else 12)
    result = run_soak(args.out.resolve(), seed=args.seed, steps=steps, kinds=kinds)
    print(result.format())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
