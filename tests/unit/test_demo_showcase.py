"""The demo's words: what each fault demonstrates (before the loop) and what it showed (after),
read from the chaos loop's report."""

from __future__ import annotations

from vime.harness.chaos import ChaosReport, format_faults
from vime.harness.demo import judge, plan_lines, showcase
from vime.harness.faults import Fault
from vime.trainer.rl_loop import StepRecord


def _step(n: int, **cut) -> StepRecord:
    return StepRecord(step=n, round=n, version=n - 1, samples=32, reward_mean=0.0, loss=0.1, logprob_gap_max=1e-6,
                      digest="x", engines={}, resent=0, stale=0, pushed={}, seconds=1.0, **cut)


def _kill(**more) -> Fault:
    return Fault("kill", 3, engine="engine-0", fired_step=3, injected_at=100.0, detected_at=100.4,
                 detected_as="EXITED: exited unexpectedly (killed by SIGKILL)", ready_at=158.0, resynced_at=158.0,
                 gap_at=101.0, **more)


def test_the_plan_says_what_each_fault_demonstrates_in_step_order():
    lines = plan_lines(["--kill-at", "3", "--hang-at", "12", "--fail-push-at", "21"])
    assert [ln.split(":")[0].strip() for ln in lines] == ["step   3", "step  12", "step  21"]
    assert "continued on the other engine" in lines[0] and "takes its place at once, inside the round" in lines[0]
    assert "/health still answers 200" in lines[1] and "poisoned" in lines[2]
    assert plan_lines(["--hang-at", "2"]) == [lines[1].replace("12", " 2")]


def test_a_kill_covered_by_a_spare_shows_its_tokens_and_the_restart_it_spared():
    rep = ChaosReport(steps=[_step(1), _step(2), _step(3, tokens_cut=61, tokens_reused=61, continued=2)],
                      faults=[_kill(spare="engine-2", full_at=102.3)])
    text = "\n".join(showcase(rep))
    assert "2 request(s) cut mid-stream, continued on another engine: 61 streamed tokens reused, 0 regenerated" in text
    assert ("full strength 1.30s after the round ended: warm spare engine-2 promoted, synced and verified; "
            "a restart would have cost 58.0s (engine-0 ready again after that, now the spare)") in text
    assert "warm spare engine-2 promoted, full strength 1.30s after the round ended" in "\n".join(format_faults(rep.faults))


def test_a_kill_without_a_spare_or_a_cut_request_says_so():
    rep = ChaosReport(steps=[_step(3)], faults=[_kill(), Fault("hang", 12, note="run too short")])
    text = "\n".join(showcase(rep))
    assert "no request had streamed tokens when it died: nothing to continue" in text
    assert "full strength 57.0s after the round ended: engine-0 restarted and resynced (no spare took its place)" in text
    assert "SIGSTOP of the EngineCore: not injected (run too short)" in text


def test_a_kill_filled_inside_the_round_says_so_next_to_the_restart_it_spared():
    rep = ChaosReport(steps=[_step(3, tokens_cut=40, tokens_reused=40, continued=1)],
                      faults=[_kill(spare="engine-2", full_at=100.7)])
    text = "\n".join(showcase(rep))
    assert ("full strength 0.70s after the fault, inside the round: warm spare engine-2, already at the "
            "round's version, promoted at once; a restart would have cost 58.0s") in text
    assert "warm spare engine-2 promoted, full strength 0.70s after the fault, inside the round" in "\n".join(
        format_faults(rep.faults))


def test_the_plan_takes_the_goodput_schedules_faults_by_name():
    lines = plan_lines(["--fault", "daemon@5", "--fault", "kill@1", "--fault", "trainer-dies-mid-push@24"])
    assert [ln.split(":")[0].strip() for ln in lines] == ["step   1", "step   5", "step  24"]
    assert "re-adopts them from its journal" in lines[1] and "never served half-loaded" in lines[2]


def test_a_daemon_kill_is_judged_to_restart_no_engine():
    daemon = Fault("daemon", 5, engine="daemon", fired_step=5, injected_at=200.0, detected_at=202.0,
                   ready_at=202.0, resynced_at=202.0)
    engines = {"engine-0": {"state": "RUNNING", "weight_version": 6, "restarts": 1},
               "engine-1": {"state": "RUNNING", "weight_version": 6, "restarts": 0}}
    rep = ChaosReport(steps=[_step(n) for n in range(1, 7)], faults=[_kill(detected_cause="exit"), daemon], engines=engines,
                      final_version=6)
    assert judge(rep) == []
    engines["engine-1"]["restarts"] = 1  # a restart neither fault explains
    assert [p for p in judge(rep) if "2 engine restart(s) for 1 injected engine fault(s)" in p]


def test_the_async_runs_closing_line_says_what_it_checked_not_rounds(capsys):
    from vime.harness.demo import SYNC_ALL_GOOD, _exit_status, async_all_good
    from vime.trainer.rl_loop import Report

    rep = Report(steps=[_step(n) for n in range(1, 5)], final_version=4, mode="async", max_staleness=1,
                 updates=[{"version": v, "waves": [["engine-0"]], "seconds": {}, "failed": {}} for v in (2, 3, 4)])
    kill = {"engine": "engine-1", "version": 3, "step": 2, "seen": "EXITED: killed by SIGKILL"}
    line = async_all_good(rep, kill)
    assert line == ("all good: the kill of engine-1 during the update to v3 seen and restarted, 4 batch(es) trained, "
                    "none lost, across 3 in-flight update(s); every trained sample within max_staleness 1; every "
                    "engine on the trainer's v4")
    assert "round" not in async_all_good(rep, None)
    assert _exit_status([], None, line) == 0
    assert capsys.readouterr().out.strip() == f"{line}; demo exit status 0"
    _exit_status([], None)
    assert capsys.readouterr().out.strip() == f"{SYNC_ALL_GOOD}; demo exit status 0"
