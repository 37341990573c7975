"""The demo: a real RL loop on two vLLM engines under the daemon, with faults injected.

    make demo                   (or: python -m vime.harness.demo --out demo-run)

1. builds the tiny Llama (trainer/tiny_model.py) and writes a config for three engines that
   accept weight pushes (gloo on CPU): two serve, one is a warm spare (`spares = 1`);
2. starts `python -m vime.supervisor` as a plain child process and waits until the two are
   RUNNING and the spare is STANDBY (booted, kept warm, never routed);
3. runs the example RL loop (trainer/rl_loop.py) under harness/chaos.py: rollouts through
   the daemon's routing, reward, a policy-gradient step, the new weights pushed into the
   engines, versions published, with a kill -9 (step --kill-at) in a round with a long tail
   (--long-tail: its long requests are cut mid-stream and continued on the other engine from
   the tokens already streamed; the spare, kept at the current weights, takes the killed
   engine's place at once, inside the round),
   a SIGSTOPped EngineCore (--hang-at) and a push that fails midway (--fail-push-at); it
   prints what each fault demonstrates before, and what it showed after;
4. shows `supervisorctl status`, stops the daemon (SIGTERM: every engine stopped) and checks
   that no engine process is left.

It ends honestly: every wait has a bound; while the engines boot it prints, every 5 s, each
engine's state and reason (the daemon's status) and the last line of its log; when an engine
goes FATAL, the daemon exits, a round is lost or a fault is not recovered from, it stops, prints
WHAT WENT WRONG and exits 1. Ctrl-C or SIGTERM stop the loop (its round ended), then the daemon
(SIGTERM: it stops its engines), then, as a last resort, SIGKILL to the daemon and to the
engines' process groups it spawned (by pid, never by name); exit status 128 + the signal. The
daemon runs in its own process group, so a Ctrl-C at the terminal reaches only the demo, which
stops things in that order. demo.json records the pids (the demo's, the daemon's, the engines').
Everything (config, daemon log, engine logs, incidents, trace.json, summary.json, dumps, and
timeline.png: the picture of the run, failed or not) stays in --out. Any flag of
`python -m vime.harness.chaos` after `--` goes to the loop.

    python -m vime.harness.demo --async [--out demo-async]

runs the async loop instead (`trainer/rl_loop.py --async`, the daemon in [weights] mode =
"async", max_staleness = 1): no rounds, the next batch streams while the trainer trains, each
version reaches the two serving engines by an in-flight update in waves, and during the update
of step --kill-during-update (default 3) the engine being updated is killed -9 once paused
(UpdateKillLoop). Flags of `python -m vime.trainer.rl_loop` after `--` go to the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, GLOO, Daemon, free_port, write_config
from vime.harness.timeline import write_for_run
from vime.trainer.tiny_model import build_tiny_model

if TYPE_CHECKING:  # imported in run(): the RL loop's modules load only when the demo runs
    from vime.harness.chaos import ChaosReport, DaemonKeeper
    from vime.trainer.rl_loop import AsyncRLLoop, Report

BOOT = 300.0
UP = ("RUNNING", "STANDBY")  # serving, or a warm spare


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def demo_config(out: Path, model: Path, *, engines: int = 2, interval: float = 1.0, timeout: float = 2.0,
                threshold: int = 2, models: dict[str, Path] | None = None, boot: float = BOOT,
                python: str | None = None, spares: int = 0, supervisor: dict | None = None,
                **sections: dict) -> Path:
    """The daemon config the demo (and its tests and the soak) runs: fast probes, engines
    engine-0.. on this host. `models` gives an engine its own model path; `sections` adds
    tables (e.g. restart={...}); `boot` is first_wait; `python` the engines' interpreter;
    `spares` of the engines are warm spares; `supervisor` more [supervisor] keys."""
    cpus = max(1, os.cpu_count() or 1)
    names = [f"engine-{i}" for i in range(engines)]
    return write_config(
        out / "supervisor.toml",
        supervisor={"runtime_dir": str(out / "run"), "log_dir": str(out / "logs"), "stop_timeout": 5.0,
                    "min_healthy": 1, "sync_timeout": 60.0, **({"python": python} if python else {}),
                    # A spare kept at the current weights (one more receiver per push) can take a
                    # failed engine's place at once, inside the round.
                    **({"spares": spares, "spares_sync": "publish", "admit_mid_round": True} if spares else {}),
                    **(supervisor or {})},
        health_check={"first_wait": boot, "interval": interval, "timeout": timeout,
                      "failure_threshold": threshold},
        **sections,
        engine_defaults={"args": ENGINE_ARGS + GLOO, "env": ENGINE_ENV},
        engines=[{"name": n, "model": str((models or {}).get(n, model)), "served_model_name": "tiny",
                  "port": free_port(), "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i % cpus)}}
                 for i, n in enumerate(names)],
    )


class Interrupted(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM reached the demo outside the RL loop (which has its own)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """While the demo runs, SIGINT, SIGTERM and SIGHUP (the terminal closed) raise Interrupted (the RL loop swaps in its own
    handlers while it runs, and puts these back). While it stops everything, a signal only
    asks it to hurry: straight to SIGKILL of the daemon and of the engines' groups."""

    def __init__(self) -> None:
        self.hurry = False
        self.saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def raising(self) -> None:
        for sig in self.saved:
            signal.signal(sig, self._raise)

    def hurrying(self) -> None:
        for sig in self.saved:
            signal.signal(sig, self._hurry)

    def restore(self) -> None:
        for sig, old in self.saved.items():
            signal.signal(sig, old)

    @staticmethod
    def _raise(signum: int, frame) -> None:
        raise Interrupted(signum)

    def _hurry(self, signum: int, frame) -> None:
        self.hurry = True


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:160] if lines else "(empty)"


def _engine_lines(daemon: Daemon, client, names: list[str]) -> list[str]:
    """One line per engine: its state and reason from the daemon's status over the control
    socket, and the last line of its log (from the daemon's event log when the socket does not
    answer yet)."""
    from vime.supervisor.client import SupervisorError

    try:
        engines = {e["name"]: e for e in client.status()["engines"]}
    except (SupervisorError, OSError) as e:
        return [f"  (control socket not answering yet: {type(e).__name__}) "
                + ", ".join(f"{n} {daemon.state(n) or 'not spawned'}" for n in names)]
    out = []
    for n in names:
        eng = engines.get(n, {})
        try:
            tail = _last_line(client.engine_log(n, 4096))
        except (SupervisorError, OSError) as err:
            tail = f"(no log: {err})"[:160]
        out.append(f"  {n:<10} {eng.get('state', '?'):<9} {eng.get('state_age', 0):>5.0f}s  "
                   f"{(eng.get('reason') or '')[:70]}\n  {'':<10} log: {tail}")
    return out


def wait_for_engines(daemon: Daemon, sock: Path, names: list[str], boot: float, *,
                     every: float = 5.0, on_tick=lambda: None) -> list[str]:
    """Wait, at most `boot` seconds, until every engine is RUNNING (or STANDBY: a warm
    spare), printing what they are doing every `every` seconds. Returns the problems that end
    the wait early: an engine FATAL, the daemon gone, the bound passed ([] when all are up)."""
    from vime.supervisor.client import SupervisorClient

    client = SupervisorClient(str(sock), connect_timeout=1.0, timeout=5.0)
    t0 = time.monotonic()
    next_report = t0 + every
    seen: set[str] = set()
    try:
        while True:
            states = {n: daemon.state(n) for n in names}
            for n, st in states.items():
                if st in UP and n not in seen:
                    seen.add(n)
                    _say(f"{n} {st} after {time.monotonic() - t0:.0f}s"
                         + (" (the warm spare: booted, never routed, takes a failed engine's place)"
                            if st == "STANDBY" else ""))
            if all(st in UP for st in states.values()):
                return []
            fatal = [n for n, st in states.items() if st == "FATAL"]
            if fatal:
                for line in _engine_lines(daemon, client, names):
                    print(line, flush=True)
                return [f"{n} went FATAL while booting: {_reason(daemon, n)}" for n in fatal]
            rc = daemon.proc.poll()
            if rc is not None:
                daemon._reader.join(2)
                tail = "\n    ".join(daemon.raw[-8:]) or "(no output)"
                return [f"the daemon exited with status {rc} before the engines were up:\n    {tail}"]
            now = time.monotonic()
            if now - t0 > boot:
                for line in _engine_lines(daemon, client, names):
                    print(line, flush=True)
                return ["engines not up within the boot bound of "
                        f"{boot:g}s: " + ", ".join(f"{n} {st or 'not spawned'}" for n, st in states.items())]
            if now >= next_report:
                next_report = now + every
                on_tick()
                _say(f"waiting for the engines to boot ({now - t0:.0f}s; vLLM on CPU takes ~40-60s):")
                for line in _engine_lines(daemon, client, names):
                    print(line, flush=True)
            time.sleep(0.2)
    finally:
        client.close()


def _reason(daemon: Daemon, engine: str) -> str:
    with daemon._cv:
        for ev in reversed(daemon.events):
            if ev.get("event") == "engine.transition" and ev.get("engine") == engine:
                return str(ev.get("reason"))
    return "?"


# Faults after each of which the daemon restarts the engine exactly once.
ONE_RESTART = ("kill", "hang", "push", "kill-gap", "poison-reload")
# Faults that restart no engine: the daemon's own kill -9 (its engines run on, re-adopted).
NO_RESTART = ("daemon",)


def judge(report) -> list[str]:
    """What went wrong in a run of the chaos loop, one line each ([] when nothing did): an early
    stop, lost rounds, stale answers, faults not injected, not recovered or seen with another
    cause, engines not on the trainer's version, and restarts that the faults do not explain."""
    problems = []
    if report.stopped:
        problems.append(f"the loop {report.stopped}")
    lost = [s for s in report.steps if s.lost]
    if lost:
        problems.append(f"{len(lost)} round(s) lost: " + "; ".join(f"step {s.step}: {s.error}" for s in lost[:3]))
    if report.stale_responses:
        problems.append(f"{report.stale_responses} answer(s) from engines on another version than the trainer's")
    if not report.stopped:
        for f in report.faults:
            if f.injected_at is None:
                problems.append(f"fault {f.kind} (step {f.step}) was not injected: {f.note or 'run too short'}")
            elif f.resynced_at is None:
                problems.append(f"fault {f.kind} on {f.engine} (step {f.fired_step}) was not recovered from: "
                                f"{f.detected_as or 'not detected'}")
            elif wrong := f.wrong_cause():
                problems.append(f"fault {f.kind} on {f.engine} (step {f.fired_step}): {wrong}")
    for name, e in sorted(report.engines.items()):
        if e["state"] == "STANDBY":  # a warm spare: synced when it is promoted
            continue
        if e["state"] != "RUNNING" or e.get("weight_version") != report.final_version:
            problems.append(f"{name} ends {e['state']} on v{e.get('weight_version')} (trainer at v{report.final_version})")
    injected = [f for f in report.faults if f.injected_at is not None]
    if report.engines and all(f.kind in ONE_RESTART + NO_RESTART for f in injected):
        restarts = sum(e.get("restarts") or 0 for e in report.engines.values())
        want = sum(f.kind in ONE_RESTART for f in injected)
        if restarts != want:
            problems.append(f"{restarts} engine restart(s) for {want} injected engine fault(s) "
                            f"({len(injected) - want} of the daemon): an engine was stopped that no fault "
                            "explains, or one was not restarted (see the incidents in the log folder)")
    return problems


# What each fault demonstrates, said before the loop runs.
SHOWS = {
    "kill": "kill -9 of a serving engine mid-round, in a round with a long tail: the requests it was "
            "streaming are continued on the other engine from the tokens already read (none generated "
            "twice), and the warm spare, kept at the current weights, takes its place at once, inside the "
            "round, instead of a ~1 min restart after it",
    "hang": "SIGSTOP of an EngineCore (its /health still answers 200): seen as hung by the daemon's "
            "probes, taken out of routing and restarted; a spare, if there is one, serves in its place",
    "push": "a weight push failing halfway (the engine holds half a version): reported poisoned, never "
            "routed again on those weights, restarted; a spare, if there is one, serves in its place",
    "kill-gap": "kill -9 of an engine between rounds: seen as exited, restarted and resynced; the next "
                "round opens with the engines left, a spare, if there is one, in its place",
    "daemon": "kill -9 of the daemon mid-round, started again 1 s later: the engines serve on, the new "
              "daemon re-adopts them from its journal; no engine restarted",
    "kill-mid-push": "kill -9 of one receiver once half the step's broadcast is sent: the push fails for it "
                     "within its bound, the survivors are pushed again, it is restarted",
    "stop-mid-push": "SIGSTOP of one receiver once half the step's broadcast is sent: the collective stalls, "
                     "the push fails within its bound, the daemon sees it hung and restarts it",
    "trainer-dies-mid-push": "the trainer's push killed -9 halfway: every receiver is left paused, condemned "
                             "past the announced push's deadline and restarted, never served half-loaded",
}


def plan_lines(loop_argv: list[str]) -> list[str]:
    """What each fault of the loop's flags demonstrates, one line each, in step order."""
    from vime.harness.chaos import KEEPER_KINDS, build_parser
    from vime.harness.faults import WHAT

    a = build_parser(KEEPER_KINDS).parse_args(["--model", "-", *loop_argv])
    plan = [("kill", a.kill_at), ("hang", a.hang_at), ("push", a.fail_push_at), *(a.fault or [])]
    return [f"  step {step:>3}: {SHOWS.get(kind, WHAT[kind])}"
            for kind, step in sorted(plan, key=lambda kv: kv[1]) if step]


def showcase(report) -> list[str]:
    """What the faults showed, from the report: for each, how it was seen and when the fleet
    was whole again; for a kill, the requests cut mid-stream and what became of their tokens;
    for a fault a spare covered, the spare's promotion next to the restart it spared."""
    from vime.harness.chaos import fmt_seconds
    from vime.harness.faults import IN_ROUND, WHAT

    lines = ["", "what the faults showed"]
    steps = {s.step: s for s in report.steps}
    for f in report.faults:
        if f.injected_at is None:
            lines.append(f"  {WHAT[f.kind]}: not injected ({f.note or 'run too short'})")
            continue
        lines.append(f"  {WHAT[f.kind]} of {f.engine} (step {f.fired_step}): seen after "
                     f"{fmt_seconds(f.after(f.detected_at))} as {(f.detected_as or 'not detected')[:80]}")
        s = steps.get(f.fired_step)
        if f.kind == "kill" and s is not None:
            if s.tokens_cut:
                lines.append(f"    {s.continued} request(s) cut mid-stream, continued on another engine: "
                             f"{s.tokens_reused} streamed tokens reused, {s.tokens_regenerated} regenerated")
            else:
                lines.append("    no request had streamed tokens when it died: nothing to continue")
        gap = "the round ended" if f.kind in IN_ROUND else "the fault"
        if f.spare is not None and f.filled_in_round():
            lines.append(f"    full strength {fmt_seconds(f.after(f.full_at))} after the fault, inside the round: "
                         f"warm spare {f.spare}, already at the round's version, promoted at once; a restart "
                         f"would have cost {fmt_seconds(f.after(f.ready_at))} and waited for the round's end "
                         f"({f.engine} ready again after that, now the spare)")
        elif f.spare is not None:
            lines.append(f"    full strength {fmt_seconds(f.full_after_gap())} after {gap}: warm spare {f.spare} "
                         f"promoted, synced and verified; a restart would have cost "
                         f"{fmt_seconds(f.after(f.ready_at))} ({f.engine} ready again after that, now the spare)")
        else:
            lines.append(f"    full strength {fmt_seconds(f.full_after_gap())} after {gap}: {f.engine} "
                         f"restarted and resynced (no spare took its place)")
    return lines


class _Record:
    """demo.json: the pids (the demo's, the daemon's, the engines'), then the verdict;
    rewritten whole at each change, so a watcher never reads half of it."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict = {"demo_pid": os.getpid(), "daemon_pid": None, "engine_pids": []}
        self.save()

    def save(self, **more) -> None:
        self.data.update(more)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def _supervisorctl_status(sock: Path) -> None:
    env = {**os.environ, "VIME_SUPERVISOR_SOCKET": str(sock)}
    print("\n$ supervisorctl status")
    try:
        st = subprocess.run([str(Path(sys.executable).parent / "supervisorctl"), "status"], env=env,
                            capture_output=True, text=True, timeout=30)
        print(st.stdout + st.stderr, end="")
    except subprocess.TimeoutExpired:
        print("(no answer within 30s)")


def _run_loop(keeper: DaemonKeeper, model: Path, sock: Path, out: Path, loop_argv: list[str], *,
              engines: int, spares: int, sig: _Signals, record: _Record) -> ChaosReport:
    """The RL loop under its faults; its report and what it showed, printed."""
    from vime.harness.chaos import KEEPER_KINDS, ChaosLoop, build_parser, format_report

    args = build_parser(KEEPER_KINDS).parse_args(["--model", str(model), "--socket", str(sock), "--out", str(out),
                                                  "--save-debug-rollout-data", str(out / "dumps" / "{rollout_id}.jsonl"),
                                                  "--stop-on-fatal", *loop_argv])
    _say("running the RL loop: " + " ".join(loop_argv or ["(defaults)"]))
    _say(f"{engines - spares} engine(s) serve, {spares} warm spare(s); the faults and what each demonstrates:")
    for line in plan_lines(loop_argv):
        print(line, flush=True)
    report = ChaosLoop(args, hooks=keeper).run()
    sig.raising()  # the loop's own handlers are gone again
    record.save(daemon_pid=keeper.daemon.proc.pid, engine_pids=keeper.spawned_pids())
    print(format_report(report))
    print("\n".join(showcase(report)))
    return report


# -- --async: the async loop, killed during an update -----------------------------------------

ASYNC_LOOP_ARGV = ["--num-rollout", "8", "--rollout-max-response-len", "48", "--serving-fraction", "0.5",
                   "--kill-during-update", "3"]
_update_kill_loop: type | None = None


def update_kill_loop() -> type[AsyncRLLoop]:
    """UpdateKillLoop (made on first use: the RL loop's modules load only when a loop runs):
    the async loop (trainer/rl_loop.py --async) with a kill -9 during one in-flight update. At
    --kill-during-update K, the first engine the update to step K's version pushes into is
    killed once the update has paused it (its requests cut with their tokens so far); the
    update goes on without it. `kill` says what was done, and after the run what the daemon
    made of it."""
    global _update_kill_loop
    if _update_kill_loop is not None:
        return _update_kill_loop
    from vime.trainer.rl_loop import AsyncRLLoop

    class UpdateKillLoop(AsyncRLLoop):
        def __init__(self, args: argparse.Namespace):
            super().__init__(args)
            self.kill: dict | None = None

        async def push_in_flight(self, engine, tensors, version: int) -> str:
            at = self.args.kill_during_update
            if self.kill is None and at and version == self.base + at:
                engines = await asyncio.to_thread(self.view.engines)
                pid = next(e.get("pid") for e in engines if e["name"] == engine.name)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    self.kill = {"engine": engine.name, "pid": pid, "version": version, "step": at,
                                 "at": time.time()}
                    self.log(f"kill -9 of {engine.name} (pid {pid}) during the update to v{version}, once paused")
            return await super().push_in_flight(engine, tensors, version)

        def after_run(self) -> None:
            """What the daemon made of the kill: how it was seen, and which spare took the place."""
            if self.kill is None:
                return
            k, t0 = self.kill, self.kill["at"]
            for ev in self.recorder.events:
                if ev.get("event") != "transition" or ev.get("ts", 0) < t0:
                    continue
                if ev.get("engine") == k["engine"] and "seen" not in k:
                    k["seen"], k["seen_after"] = f"{ev.get('to_state')}: {ev.get('reason')}", ev["ts"] - t0
                elif (ev.get("engine") != k["engine"] and ev.get("from_state") == "STANDBY"
                      and ev.get("to_state") in ("RUNNING", "STALE", "SYNCING") and "spare" not in k):
                    k["spare"], k["spare_after"] = ev.get("engine"), ev["ts"] - t0
            (self.out / "kill.json").write_text(json.dumps(k, indent=1, default=str))

    _update_kill_loop = UpdateKillLoop
    return UpdateKillLoop


def async_sections(on: bool) -> dict[str, Any]:
    """The daemon config's tables for --async: async mode, one version of staleness allowed."""
    return {"weights": {"mode": "async", "max_staleness": 1}} if on else {}


def async_parser() -> argparse.ArgumentParser:
    from vime.trainer.rl_loop import build_parser

    ap = build_parser(prog="python -m vime.harness.demo --async --")
    ap.add_argument("--kill-during-update", type=int, default=0, metavar="K",
                    help="kill -9 the first engine the update to step K's version pauses (0: none)")
    return ap


def judge_async(rep: Report, kill: dict | None, planned: bool, restarts_before: int = 0) -> list[str]:
    """What went wrong in an async run ([] when nothing did): an early stop, lost batches, the
    kill not done or not seen as an exit, a trained sample past max_staleness, engines not on
    the trainer's version, restarts the kill does not explain (`restarts_before`: the
    daemon's count when the run began; the status counts every restart since the daemon's)."""
    problems = []
    if rep.stopped:
        problems.append(f"the loop {rep.stopped}")
    lost = [s for s in rep.steps if s.lost]
    if lost:
        problems.append(f"{len(lost)} batch(es) lost: " + "; ".join(f"step {s.step}: {s.error}" for s in lost[:3]))
    if planned and kill is None:
        problems.append("the kill during an update was not done (run too short?)")
    if kill is not None and not str(kill.get("seen", "")).startswith("EXITED"):
        problems.append(f"the kill of {kill['engine']} was seen as {kill.get('seen', 'nothing')}")
    from vime.supervisor.states import VersionRule, WeightsMode

    rule = VersionRule(WeightsMode.ASYNC, rep.max_staleness)
    for s in rep.steps:
        past = [v for v in s.span_versions if s.version is None or any(rule.too_old(x, s.version) for x in v)]
        if past:
            problems.append(f"step {s.step} trained on {len(past)} sample(s) past max_staleness "
                            f"{rep.max_staleness} of v{s.version}: {past[:3]}")
    for name, e in sorted(rep.engines.items()):
        if e["state"] != "STANDBY" and (e["state"] != "RUNNING" or e.get("weight_version") != rep.final_version):
            problems.append(f"{name} ends {e['state']} on v{e.get('weight_version')} (trainer at v{rep.final_version})")
    restarts = sum(e.get("restarts") or 0 for e in rep.engines.values()) - restarts_before
    if rep.engines and restarts != (kill is not None):
        problems.append(f"{restarts} engine restart(s) for {int(kill is not None)} kill(s)")
    return problems


def showcase_async(rep: Report, kill: dict | None) -> list[str]:
    """What the async run showed: the updates, the kill during one, the spans and the bound."""
    lines = ["", "what the async run showed"]
    secs = [v for u in rep.updates for v in u["seconds"].values()]
    waves = next((u["waves"] for u in rep.updates if len(u["waves"]) > 1), rep.updates[0]["waves"] if rep.updates else [])
    lines.append(f"  {len(rep.updates)} in-flight update(s) while the next batch streamed, e.g. in waves {waves}; "
                 f"each engine paused to serving again in {min(secs, default=0):.2f}-{max(secs, default=0):.2f}s")
    if kill is not None:
        upd = next((u for u in rep.updates if u["version"] == kill["version"] and kill["engine"] in u["failed"]), None)
        lines.append(f"  kill -9 of {kill['engine']} during the update to v{kill['version']} (step {kill['step']}), "
                     f"paused: seen after {kill.get('seen_after', float('nan')):.2f}s as "
                     f"{str(kill.get('seen', 'not seen'))[:70]}")
        lines.append(f"    the update went on without it ({'its push failed: ' + upd['failed'][kill['engine']][:60] if upd else 'no failure recorded'})"
                     + (f"; warm spare {kill['spare']} promoted {kill['spare_after']:.2f}s after the kill, "
                        "updated in the same update's second pass" if "spare" in kill else ""))
        after = next((s for s in rep.steps if s.step == kill["step"] + 1), None)
        if after is not None:
            lines.append(f"    step {after.step}'s batch (streaming during that update): {after.continued} request(s) "
                         f"continued from their streamed tokens, {after.tokens_reused} tokens reused, "
                         f"{after.tokens_regenerated} regenerated")
    trained = [v for s in rep.steps for v in s.span_versions]
    lines.append(f"  {sum(len(set(v)) > 1 for v in trained)} of {len(trained)} trained samples span two versions "
                 f"(cut by an update, continued on the new weights); {sum(s.past_staleness for s in rep.steps)} "
                 f"past max_staleness {rep.max_staleness} left out, {rep.stale_regenerated} regenerated by the client")
    return lines


SYNC_ALL_GOOD = "all good: every fault detected and recovered from, no round lost"


def async_all_good(rep: Report, kill: dict | None) -> str:
    """The closing line of an async run that judge_async found nothing wrong with: what it
    checked (an async run has no rounds: its batches stream across in-flight updates)."""
    kill_part = (f"the kill of {kill['engine']} during the update to v{kill['version']} seen and restarted, "
                 if kill is not None else "")
    return (f"all good: {kill_part}{len(rep.steps)} batch(es) trained, none lost, across {len(rep.updates)} "
            f"in-flight update(s); every trained sample within max_staleness {rep.max_staleness}; every engine "
            f"on the trainer's v{rep.final_version}")


def _run_async_loop(keeper: DaemonKeeper, model: Path, sock: Path, out: Path, loop_argv: list[str], *,
                    sig: _Signals, record: _Record) -> tuple[list[str], str]:
    """The async loop with its kill during an update; what it showed, printed; its problems
    and its closing line when there are none."""
    from vime.trainer.rl_loop import check_args, format_report

    ap = async_parser()
    args = ap.parse_args(["--model", str(model), "--socket", str(sock), "--out", str(out), "--async",
                          "--stop-on-fatal", *loop_argv])
    check_args(ap, args)
    _say("running the async RL loop: " + " ".join(loop_argv))
    if args.kill_during_update:
        _say(f"step {args.kill_during_update}: kill -9 of a serving engine during the in-flight update of its "
             "version, once paused: its cut requests continue on another engine at an allowed version, the "
             "warm spare takes its place at once (no round to wait for), the daemon restarts it")
    loop: Any = update_kill_loop()(args)
    rep = loop.run()
    sig.raising()  # the loop's own handlers are gone again
    record.save(daemon_pid=keeper.daemon.proc.pid, engine_pids=keeper.spawned_pids())
    print(format_report(rep))
    print("\n".join(showcase_async(rep, loop.kill)))
    if rep.signal is not None:
        raise Interrupted(rep.signal)
    return judge_async(rep, loop.kill, bool(args.kill_during_update)), async_all_good(rep, loop.kill)


def _exit_status(problems: list[str], signum: int | None, all_good: str = SYNC_ALL_GOOD) -> int:
    """0 when nothing went wrong, else 128 + the signal that stopped it, else 1; said."""
    status = 0 if not problems else 128 + signum if signum is not None else 1
    if problems:
        print("\nWHAT WENT WRONG")
        for p in problems:
            print(f"  - {p}")
        print(f"demo exit status {status}")
    else:
        print(f"\n{all_good}; demo exit status 0")
    return status


def run(out: Path, loop_argv: list[str], *, engines: int, interval: float, timeout: float, threshold: int,
        model: Path | None = None, python: str | None = None, boot: float = BOOT, spares: int = 0,
        async_: bool = False) -> int:
    """The demo; its exit status: 0 when everything went as it should, 1 when something went
    wrong (printed), 128 + the signal when SIGINT/SIGTERM stopped it."""
    from vime.harness.chaos import DaemonKeeper
    from vime.trainer.rl_loop import quiet_rollout_log

    quiet_rollout_log()
    out.mkdir(parents=True, exist_ok=True)
    record = _Record(out / "demo.json")
    sig = _Signals()
    sig.raising()
    problems: list[str] = []
    signum: int | None = None
    all_good = SYNC_ALL_GOOD  # the closing line when nothing went wrong (the async run's says what it checked)
    keeper: DaemonKeeper | None = None  # the daemon now, and each one a daemon fault replaced
    log_file = None
    names = [f"engine-{i}" for i in range(engines)]
    try:
        if model is None:
            _say(f"building the tiny model in {out / 'model'}")
            model = build_tiny_model(out / "model")
        cfg = demo_config(out, model, engines=engines, interval=interval, timeout=timeout, threshold=threshold,
                          boot=boot, python=python, spares=spares,
                          **async_sections(async_))
        sock = out / "run" / "supervisor.sock"
        _say(f"starting the daemon: python -m vime.supervisor --config {cfg}")
        log_file = open(out / "daemon.log", "w")
        keeper = DaemonKeeper(lambda: Daemon(cfg, tee=log_file, own_group=True))
        record.save(daemon_pid=keeper.daemon.proc.pid)
        problems = wait_for_engines(keeper.daemon, sock, names, boot,
                                    on_tick=lambda: record.save(engine_pids=keeper.spawned_pids()))
        record.save(engine_pids=keeper.spawned_pids())
        if not problems and async_:
            problems, all_good = _run_async_loop(keeper, model, sock, out, loop_argv, sig=sig, record=record)
            _supervisorctl_status(sock)
        elif not problems:
            report = _run_loop(keeper, model, sock, out, loop_argv, engines=engines, spares=spares,
                               sig=sig, record=record)
            signum = report.signal
            problems = judge(report)
            _supervisorctl_status(sock)
    except Interrupted as e:
        signum = e.signum
        problems.append(f"interrupted by {e}")
    except Exception as e:  # noqa: BLE001 - whatever it was, everything is stopped and it is said
        problems.append(f"the demo failed: {type(e).__name__}: {e}")
    finally:
        sig.hurrying()
        rc: int | None = None
        left: list[tuple[int, int, str]] = []
        if keeper is not None:
            _say("stopping: SIGTERM to the daemon (it stops every engine; SIGKILL after 30s)")
            rc, left = keeper.daemon.stop_all(30.0, hurry=lambda: sig.hurry, say=_say, also=keeper.spawned_pids())
            record.save(engine_pids=keeper.spawned_pids())
        if log_file is not None:
            log_file.close()
        sig.restore()
    if keeper is not None:
        if rc != 0 and not problems:
            problems.append(f"the daemon's exit status was {rc}")
        if left:
            problems.append(f"{len(left)} engine process(es) outlived the daemon and were killed")
        print(f"\ndaemon exit status {rc}; engine processes left {len(left)}")
    print(f"config, daemon log, engine logs, trace.json (Perfetto), summary.json, dumps: {out}")
    status = _exit_status(problems, signum, all_good)
    record.save(ok=not problems, problems=problems, daemon_exit=rc, processes_left=len(left), exit_status=status)
    write_for_run(out, say=_say)  # the picture of the run, failed or not
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    loop_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("demo-run"))
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--spares", type=int, default=1, help="of the engines, warm spares (default 1)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--failure-threshold", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None, help="an existing model directory (default: build the tiny one)")
    ap.add_argument("--python", default=None, help="the engines' interpreter (default: this one)")
    ap.add_argument("--boot", type=float, default=BOOT,
                    help=f"longest wait for the engines to be RUNNING, each start's first_wait (default {BOOT:g})")
    ap.add_argument("--async", dest="async_", action="store_true",
                    help="the async loop (no rounds, in-flight updates), killed during an update; loop flags after -- "
                         f"are python -m vime.trainer.rl_loop's (default: {' '.join(ASYNC_LOOP_ARGV)})")
    args = ap.parse_args(argv)
    if args.async_:
        loop_argv = loop_argv or ASYNC_LOOP_ARGV
    loop_argv = loop_argv or ["--num-rollout", "30", "--kill-at", "3", "--long-tail", "4", "--hang-at", "12",
                              "--fail-push-at", "21"]
    return run(args.out.resolve(), loop_argv, engines=args.engines, interval=args.interval, timeout=args.timeout,
               threshold=args.failure_threshold, model=args.model and args.model.resolve(), python=args.python,
               boot=args.boot, spares=args.spares, async_=args.async_)


if __name__ == "__main__":
    sys.exit(main())
