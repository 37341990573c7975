"""The main job, shortened: the example RL loop on two real vLLM engines under the daemon, one
serving and one warm spare kept at the current weights (the demo's `spares` settings), with a
kill -9 in a round with a long tail, a hung EngineCore and a push failing midway injected at its
hook points (harness/chaos.py); then the plain loop's dump/replay flags
(`python -m vime.trainer.rl_loop`) on its output.

Each fault takes the serving engine down: the spare is promoted into its place inside the
round, the requests the kill cut mid-stream are continued there from the tokens already read,
and the failed engine comes back as the spare. Two engines, one per core (a third would share
a core on this 2-core machine and slow every boot on it). ~5 minutes, most of it vLLM boots.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from vime.harness.chaos import ChaosLoop, build_parser, format_report
from vime.harness.demo import demo_config, judge
from vime.harness.local_daemon import Daemon, live_pids_in_groups
from vime.supervisor.client import SupervisorClient
from vime.trainer.dumps import dump_path, load_rollout

pytestmark = pytest.mark.engine

BOOT = 240
STEPS = 5
SAMPLES = 2 * 4  # --rollout-batch-size x --n-samples-per-prompt below


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    # The demo's own tight probes (interval 1 s, timeout 2 s, threshold 2), from cold compiler
    # caches: the daemon keeps each engine's under this new state directory.
    cfg = demo_config(root, tiny_model, spares=1)
    daemon = Daemon(cfg)
    try:
        daemon.wait_for(lambda e: e.get("event") == "supervisor.ready", BOOT * 2)
        yield root, daemon, str(root / "run" / "supervisor.sock")
    finally:
        pids = set(daemon.spawned_pids())
        assert daemon.terminate(60) == 0
        assert live_pids_in_groups(pids) == []


def daemon_log(daemon: Daemon, t0: float | None, t1: float | None, pad: float = 2.0) -> list[str]:
    """The daemon's own log lines (its structlog events) from t0 - pad to t1 + pad: what a
    failed timing assertion needs to be read from CI's output alone."""
    if t0 is None:
        return []
    end = (t1 or t0 + 60) + pad
    out = []
    for ev in list(daemon.events):
        try:
            ts = datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
        except (KeyError, ValueError, AttributeError):
            continue
        if t0 - pad <= ts <= end and not str(ev.get("event", "")).startswith("probe"):
            rest = {k: v for k, v in ev.items() if k not in ("timestamp", "event", "level", "logger")}
            out.append(f"{ts - t0:+.2f} {ev.get('event')} {json.dumps(rest, default=str)[:300]}")
    return out


def loop_args(root: Path, sock: str | None, model: Path, *extra: str):
    return build_parser().parse_args([
        "--model", str(model), *(["--socket", sock] if sock else []), "--out", str(root / "out"),
        "--num-rollout", str(STEPS), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--fault-wait", str(BOOT), "--final-wait", str(BOOT), *extra])


@pytest.fixture(scope="module")
def live_run(world, tiny_model):
    root, daemon, sock = world
    args = loop_args(root, sock, tiny_model, "--kill-at", "2", "--long-tail", "2", "--hang-at", "3", "--fail-push-at", "4",
                     "--save-debug-rollout-data", str(root / "dumps" / "{rollout_id}.jsonl"))
    report = ChaosLoop(args).run()
    print(format_report(report))
    return report


def test_faults_are_detected_and_every_engine_ends_on_the_trainers_version(world, live_run):
    rep = live_run
    assert rep.rounds_lost == 0 and rep.stale_responses == 0
    assert [s.samples for s in rep.steps] == [SAMPLES] * STEPS
    kinds = {f.kind: f for f in rep.faults}
    assert set(kinds) == {"kill", "hang", "push"}
    for f in rep.faults:
        assert f.injected_at is not None, f"{f.kind} was not injected: {f.note}"
        assert f.detected_at is not None and f.resynced_at is not None, f.as_dict()
        assert f.detected_at < f.ready_at < f.resynced_at
    assert kinds["kill"].detected_as.startswith("EXITED: exited unexpectedly (killed by SIGKILL)")
    assert kinds["hang"].detected_as.startswith("UNHEALTHY: hung:")
    assert kinds["push"].detected_as.startswith("UNHEALTHY: poisoned: push of v")
    assert "(reported by the trainer)" in kinds["push"].detected_as
    # Each fault's place was taken by the spare, kept current: inside the round for the kill and
    # the hang, in the gap for the failed push (it happens there); the failed engine came back
    # as the spare (never routed on base weights).
    for f in rep.faults:
        assert f.spare is not None and f.filled_in_round() == (f.kind != "push"), \
            (f.as_dict(), daemon_log(world[1], f.injected_at, f.resynced_at))
        assert f.resync_reason.startswith("back as the spare"), f.as_dict()
    # The kill cut the long tail mid-stream: continued from the streamed tokens, none generated twice.
    assert sum(s.continued for s in rep.steps) >= 1 and sum(s.tokens_reused for s in rep.steps) > 0
    assert sum(s.tokens_regenerated for s in rep.steps) == 0
    # The daemon's structured causes, which the demo's and the soak's verdicts read.
    assert {k: f.detected_cause for k, f in kinds.items()} == {"kill": "exit", "hang": "hang", "push": "poisoned"}
    assert [f.wrong_cause() for f in rep.faults] == [None] * 3
    assert rep.final_version == STEPS
    assert sorted(e["state"] for e in rep.engines.values()) == ["RUNNING", "STANDBY"]
    serving = next(e for e in rep.engines.values() if e["state"] == "RUNNING")
    assert serving["weight_version"] == STEPS
    assert all(s["ok"] for s in rep.syncs)
    # The demo's verdict on this run (what makes `make demo` exit 0 or 1): nothing went wrong,
    # and the daemon restarted engines exactly once per injected fault (no healthy one stopped).
    assert rep.stopped is None and rep.signal is None
    assert sum(e["restarts"] for e in rep.engines.values()) == len(rep.faults) == 3
    assert judge(rep) == []
    # The daemon agrees, and the engines hold the trainer's weights: vLLM's logprobs of the
    # sampled tokens equal the trainer's own to float32 rounding at every step.
    status = SupervisorClient(world[2]).status()
    assert status["weight_version"] == STEPS
    assert all(s.logprob_gap_max is not None and s.logprob_gap_max < 1e-3 for s in rep.steps)
    assert all(0.0 <= s.reward_mean <= 1.0 for s in rep.steps)
    summary = json.loads((world[0] / "out" / "summary.json").read_text())
    assert summary["rounds_lost"] == 0 and len(summary["faults"]) == 3
    assert (world[0] / "out" / "trace.json").exists()


def test_replayed_dumps_train_to_the_same_weights(world, live_run, tiny_model, tmp_path):
    """--debug-train-only --load-debug-rollout-data: no daemon, no engine; the same samples
    give the same weights as the live run, bit for bit, step by step."""
    root = world[0]
    template = str(root / "dumps" / "{rollout_id}.jsonl")
    for step in range(1, STEPS + 1):
        assert len(load_rollout(dump_path(template, step)).samples) == SAMPLES
    out = tmp_path / "replay"
    proc = subprocess.run([sys.executable, "-m", "vime.trainer.rl_loop", "--model", str(tiny_model), "--out", str(out),
                           "--num-rollout", str(STEPS), "--debug-train-only", "--load-debug-rollout-data", template],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    replay = json.loads((out / "summary.json").read_text())
    assert [s["digest"] for s in replay["steps"]] == [s.digest for s in live_run.steps]
    assert [s["reward_mean"] for s in replay["steps"]] == [s.reward_mean for s in live_run.steps]


def test_debug_rollout_only_rolls_out_without_training(world, live_run, tiny_model, tmp_path):
    root, daemon, sock = world
    before = SupervisorClient(sock).status()
    proc = subprocess.run([sys.executable, "-m", "vime.trainer.rl_loop", "--model", str(tiny_model), "--socket", sock,
                           "--out", str(tmp_path), "--num-rollout", "2", "--debug-rollout-only"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["samples"] for s in summary["steps"]] == [4 * 8, 4 * 8]  # the defaults
    assert all(s["loss"] is None and s["digest"] is None for s in summary["steps"])
    after = SupervisorClient(sock).status()
    assert after["weight_version"] == before["weight_version"]  # nothing was pushed or published
    assert after["round"] == before["round"] + 2


def test_bad_flags_are_refused_with_what_to_do(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "vime.trainer.rl_loop", "--model", str(tiny_model), "--debug-train-only"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs --load-debug-rollout-data" in proc.stderr


# -- the async loop (trainer/rl_loop.py --async) on this module's engines ----------------------

ASYNC_STEPS = 4


def test_async_against_a_sync_daemon_says_what_to_set(world, tiny_model, tmp_path):
    """--async against this module's daemon in sync mode: exit 2 with what to set, before
    anything is pushed or published."""
    sock = world[2]
    before = SupervisorClient(sock).status()
    proc = subprocess.run([sys.executable, "-m", "vime.trainer.rl_loop", "--model", str(tiny_model), "--socket", sock,
                           "--out", str(tmp_path), "--async"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'set [weights] mode = "async" and max_staleness = 1' in proc.stderr, proc.stderr
    assert SupervisorClient(sock).status()["weight_version"] == before["weight_version"]


def test_async_loop_with_a_kill_during_an_update(world, tiny_model, tmp_path, caplog):
    """`--async` on the same two engines, the daemon reloaded in place (SIGHUP: the engines are
    re-adopted, not booted again) into [weights] mode = "async", max_staleness = 1: no rounds,
    each step's batch streams while the last one trains, each version goes out by an in-flight
    update. During the update of step 2 the serving engine is killed -9 once paused: the
    update goes on without it, the spare takes its place and is updated in the same update,
    the daemon restarts the killed one at once. Every trained sample is within the bound of
    the version it was trained from; the run finishes with the fleet on the last version."""
    from vime.harness.demo import async_parser, judge_async, update_kill_loop
    from vime.supervisor.states import VersionRule
    from vime.trainer.rl_loop import format_report as loop_report

    caplog.set_level(logging.INFO, logger="vime.rollout")  # each start-over's why, for the assertion below
    root, daemon, sock = world
    cfg = root / "supervisor.toml"
    cfg.write_text(cfg.read_text() + '\n[weights]\nmode = "async"\nmax_staleness = 1\n')
    mark = daemon.mark()
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == 1, 120, after=mark)
    client = SupervisorClient(sock)
    until = time.monotonic() + 60
    while sorted(e["state"] for e in client.status()["engines"]) != ["RUNNING", "STANDBY"]:
        assert time.monotonic() < until, client.status()["engines"]
        time.sleep(0.5)
    assert VersionRule.from_answer(client.routable_engines()).bound == 1
    assert not [e for e in daemon.events[mark:] if e.get("event") == "engine.spawned"]  # no boot
    before = client.status()
    restarts = sum(e["restarts"] for e in before["engines"])

    args = async_parser().parse_args([
        "--model", str(tiny_model), "--socket", sock, "--out", str(tmp_path), "--async",
        "--num-rollout", str(ASYNC_STEPS), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "48", "--kill-during-update", "2", "--final-wait", str(BOOT)])
    loop = update_kill_loop()(args)
    rep = loop.run()
    print(loop_report(rep))
    kill = loop.kill
    assert kill is not None and kill["seen"].startswith("EXITED"), kill
    assert kill.get("spare") is not None, kill  # the spare took the killed engine's place at once
    assert judge_async(rep, kill, True, restarts_before=restarts) == []  # the module's earlier faults restarted some
    base = 0 if before["weight_version"] is None else before["weight_version"] + 1  # ours went out first
    assert rep.final_version == base + ASYNC_STEPS and rep.mode == "async" and rep.max_staleness == 1
    assert len(rep.steps) == ASYNC_STEPS and not any(s.lost for s in rep.steps)
    for s in rep.steps:  # trained from v(base + step - 1), on samples within one version of it
        assert s.version == base + s.step - 1
        assert s.samples + s.past_staleness == SAMPLES
        for versions in s.span_versions:
            assert versions == sorted(versions) and all(0 <= s.version - v <= 1 for v in versions), (s.step, versions)
    # Cut requests (by the updates' pauses, by the kill) continued from their streamed tokens:
    # none generated twice, none regenerated for staleness; some sample spans two versions.
    assert sum(s.continued for s in rep.steps) >= 1
    over = [r.getMessage() for r in caplog.records if "starting over" in r.getMessage() or "no engine" in r.getMessage()]
    assert sum(s.tokens_regenerated for s in rep.steps) == 0 and rep.stale_regenerated == 0, over[:4]
    assert any(len(set(v)) > 1 for s in rep.steps for v in s.span_versions)
    # The update of the kill's version failed in the killed engine alone; a second pass updated the spare.
    upd = [u for u in rep.updates if u["version"] == kill["version"]]
    assert [sorted(u["failed"]) for u in upd] == [[kill["engine"]], []], upd
    assert kill["spare"] in upd[1]["seconds"]
    # Each wave was announced to the daemon as a push (its pauses excused for the push's bound)
    # and ended with its failed engines named; the daemon's answers (read again) are the pushes.
    for u in rep.updates:
        assert all(isinstance(p, dict) for p in u["pushes"]), u  # not an error's text
        assert [(p["version"], sorted(p["engines"]), sorted(p["failed"])) for p in u["pushes"]] == [
            (u["version"], sorted(w), sorted(set(w) & set(u["failed"]))) for w in u["waves"]], u
    versions = {u["version"] for u in rep.updates}
    begun = [e for e in daemon.events[mark:] if e.get("event") == "push.begin" and e.get("version") in versions]
    assert sorted((e["version"], sorted(e["engines"])) for e in begun) == sorted(
        (u["version"], sorted(w)) for u in rep.updates for w in u["waves"]), begun
    # The daemon agrees: every engine on the last version (the killed one back as the spare).
    status = client.status()
    assert status["weight_version"] == rep.final_version and not status["round_open"]
    assert sorted((e["state"], e["weight_version"] if e["state"] == "RUNNING" else None)
                  for e in status["engines"]) == [("RUNNING", rep.final_version), ("STANDBY", None)]
    assert sum(e["restarts"] for e in status["engines"]) == restarts + 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mode"] == "async" and summary["samples_past_staleness"] == sum(s.past_staleness for s in rep.steps)


# -- a restarted engine and later publishes (async mode), on this module's engines ------------


class RoutableSampler:
    """The daemon's routable answer (what the rollout client reads) and its status (each
    engine's `routable` flag and version), read every `every` seconds by a thread, each read
    with the last version the test had seen published before it began."""

    def __init__(self, sock: str, every: float = 0.05):
        self.client = SupervisorClient(sock)
        self.every = every
        self.published: int | None = None  # set by the test once each publish has answered
        self.samples: list[tuple[float, int | None, dict, dict]] = []  # (t, published before, routable, status)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            before = self.published
            t = time.monotonic()
            try:
                self.samples.append((t, before, self.client.routable_engines(), self.client.status()))
            except Exception as e:  # noqa: BLE001 - said by the test, not lost with the thread
                self.errors.append(f"{t:.2f}: {type(e).__name__}: {e}")
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.close()


def test_a_restarted_engine_is_never_routable_outside_the_rule_as_later_versions_are_published(world, tiny_model):
    """The daemon in async mode (max_staleness 1; the test above's reload, here with spares = 0
    and two versions published so that both engines serve, at v). kill -9 of a serving engine:
    it restarts at once, and while it boots v+1 is published (with a checkpoint: the model's own
    directory, the label being what is checked); booted on the model's weights it is behind,
    and the daemon's own path (no trainer agent: a reload from the published checkpoint,
    verified) brings it to v+1, where it is routable at once. v+2: it serves on, one behind;
    v+3: two behind, out until reloaded and verified at v+3. The routable answer (what the
    rollout client reads) and the status, sampled every 50 ms throughout, never list an engine
    at a version more than max_staleness behind the current one, nor judge by a current
    version older than the last one published."""
    from vime.supervisor.states import VersionRule, WeightsMode

    root, daemon, sock = world
    client = SupervisorClient(sock)
    cfg = root / "supervisor.toml"
    text = cfg.read_text().replace("spares = 1\n", "spares = 0\n")
    if 'mode = "async"' not in text:  # this test run alone: the reload the test above makes
        text += '\n[weights]\nmode = "async"\nmax_staleness = 1\n'
    cfg.write_text(text)
    mark = daemon.mark()
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_for(lambda e: e.get("event") == "supervisor.started", 120, after=mark)
    rule = VersionRule.from_answer(client.routable_engines())
    assert (rule.mode, rule.bound) == (WeightsMode.ASYNC, 1)
    victim, other = "engine-0", "engine-1"
    ckpt = str(tiny_model)

    def routable_at(name: str) -> int | str | None:
        return next((e["weight_version"] for e in client.routable_engines()["engines"] if e["name"] == name), "-")

    # The spare serves once two versions are published (kept current, it goes STALE two behind,
    # is reloaded from the checkpoint and, no spare wanted now, serves); so does the other.
    start = client.status()["weight_version"] or 0
    for v in (start + 1, start + 2):
        client.publish_weights(v, checkpoint=ckpt)
    base = start + 2
    until = time.monotonic() + 120
    while not routable_at(victim) == routable_at(other) == base:
        assert time.monotonic() < until, client.status()["engines"]
        time.sleep(0.2)

    t0 = time.monotonic()
    sampler = RoutableSampler(sock)
    sampler.published = client.status()["weight_version"]

    def publish(v: int) -> None:
        client.publish_weights(v, checkpoint=ckpt)
        sampler.published = v

    try:
        mark = daemon.mark()
        killed_at = time.monotonic()
        os.kill(daemon.last_pid(victim), signal.SIGKILL)
        daemon.transition(victim, "EXITED", 10, after=mark)
        # Until the daemon sees the death it lists the victim where it was (at v, under v): the
        # samples judged below are those taken once it was seen.
        exited_at = time.monotonic()
        daemon.transition(victim, "STARTING", 10, after=mark)  # at once: async mode waits for no gap
        publish(base + 1)  # lands while it boots
        running = daemon.transition(victim, "RUNNING", BOOT, after=mark)
        assert running["reason"] == f"weights v{base + 1}, verified", running
        assert any(e.get("event") == "engine.transition" and e.get("engine") == victim
                   and e.get("to_state") == "SYNCING" and "from checkpoint" in e.get("reason", "")
                   for e in daemon.events[mark:])
        assert routable_at(victim) == base + 1
        back_at = time.monotonic()
        publish(base + 2)  # one behind: it serves on
        assert routable_at(victim) == base + 1
        e = next(e for e in client.status()["engines"] if e["name"] == victim)
        assert e["routable"] and e["version_lag"] == 1
        # Its reason says the present (supervisor/status.py), not the v+1 its sync ended at.
        assert e["reason"] == f"weights v{base + 1}, verified, 1 behind v{base + 2} (within max_staleness)", e
        time.sleep(0.5)  # sampled serving one behind
        mark2 = daemon.mark()
        publish(base + 3)  # two behind: out at once, until reloaded and verified at v+3
        assert routable_at(victim) == "-"
        daemon.transition(victim, "RUNNING", 120, after=mark2)
        until = time.monotonic() + 120  # the other one at v+2 (reloaded at v+2's publish) or v+3
        while not (routable_at(victim) == base + 3 and routable_at(other) in (base + 2, base + 3)):
            assert time.monotonic() < until, client.status()["engines"]
            time.sleep(0.2)
        time.sleep(0.3)  # a few samples of the end
    finally:
        sampler.stop()

    samples = sampler.samples
    gaps = [b[0] - a[0] for a, b in zip(samples, samples[1:])]
    print(f"\n{len(samples)} samples over {time.monotonic() - t0:.1f}s (gap median "
          f"{sorted(gaps)[len(gaps) // 2] * 1000:.0f} ms, max {max(gaps) * 1000:.0f} ms); the victim routable "
          f"again {back_at - killed_at:.1f}s after the kill")
    assert not sampler.errors and len(samples) >= 100, sampler.errors
    seen: list[tuple[int, int | str | None]] = []  # (current, the victim's listed version) while listed
    for t, published, routable, status in samples:
        current = routable["weight_version"]
        assert published is None or current >= published, (published, routable)
        for e in routable["engines"]:
            assert rule.allows(e["weight_version"], current), (t - t0, routable)
            if e["name"] == victim and t > exited_at:
                seen.append((current, e["weight_version"]))
        assert published is None or status["weight_version"] >= published, (published, status["weight_version"])
        for e in status["engines"]:
            if e["routable"]:
                assert e["state"] in ("RUNNING", "SUSPECT"), (t - t0, e)
                assert rule.allows(e["weight_version"], status["weight_version"]), (t - t0, e)
    # Listed only at versions it was verified at, each within the bound: v+1 under v+1 and
    # v+2, then v+3; never under v+3 at v+1.
    assert set(seen) <= {(base + 1, base + 1), (base + 2, base + 1), (base + 3, base + 3)}, sorted(set(seen))
    assert {(base + 2, base + 1), (base + 3, base + 3)} <= set(seen), sorted(set(seen))
