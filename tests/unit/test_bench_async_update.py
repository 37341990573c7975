"""bench/async_update.py's run around its trials, engines stood in for (the trials themselves
need real ones: the bench runs them): a failed trial, or a failed warm-up, is printed and the
exit status is 1; the table's ratios are to wait-for-drain's median of the same run."""

from __future__ import annotations

import sys

import pytest

from support.bench_scripts import load_bench


@pytest.fixture
def bench(monkeypatch, tmp_path):
    mod = load_bench("async_update")

    class Proc:
        pid = -1

        def wait(self, timeout=None):
            return 0

    pushed: list[int] = []

    async def push_all(urls, ckpt, version):
        pushed.append(version)

    monkeypatch.setattr(mod, "build_tiny_model", lambda p: p)
    monkeypatch.setattr(mod, "perturbed", lambda model, out: out)
    monkeypatch.setattr(mod, "bare_engine", lambda model, log, engine_env: (Proc(), "http://127.0.0.1:9"))
    monkeypatch.setattr(mod, "wait_healthy", lambda url, boot, proc: True)
    monkeypatch.setattr(mod, "push_all", push_all)
    monkeypatch.setattr(mod.os, "killpg", lambda pid, sig: None)  # Proc's pid -1: never signalled
    mod.pushed = pushed
    return mod


def trials(mod, fail: set[tuple[str, float]] | None = None, warm_up_fails: bool = False, misses: int = 0):
    calls: list[tuple[str, float, int]] = []

    async def one_trial(urls, version, ckpt, args, mode, fraction):
        calls.append((mode, fraction, version))
        if len(calls) == 1:
            if warm_up_fails:
                raise RuntimeError("1 request(s) failed: boom")
            return {}
        if len(calls) <= 1 + misses:
            raise mod.MissedWindow("the batch ended before each engine had a request with 48 tokens read")
        if (mode, fraction) in (fail or set()):
            raise RuntimeError("the update failed on {'A': 'x'}")
        update = {"wait": 4.0, "abort": 1.0, "keep": 2.0}[mode]
        return {"update": update, "engine": update / 2, "batch": 9.0, "recomputed": 10 if mode == "abort" else 0,
                "mixed": 5 if mode == "keep" else 0, "cut": 2, "split": 1}
    return one_trial, calls


def run_main(bench, monkeypatch, one_trial) -> int:
    monkeypatch.setattr(bench, "one_trial", one_trial)
    monkeypatch.setattr(sys, "argv", ["async_update.py", "--trials", "3"])
    try:
        bench.main()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_every_trial_ok_exits_0_with_ratios_to_wait(bench, monkeypatch, capsys):
    one_trial, calls = trials(bench)
    assert run_main(bench, monkeypatch, one_trial) == 0
    assert len(calls) == 1 + 3 * 2 * 3  # the warm-up, then trials x fractions x modes
    out = capsys.readouterr().out
    assert "| 0.5 | abort | 3 | 1.00 (1.00-1.00) | 0.50 (0.50-0.50) | 0.25 |" in out
    assert "| 0 | keep | 3 | 2.00 (2.00-2.00) | 1.00 (1.00-1.00) | 0.50 |" in out
    assert "host load average (1/5/15 min)" in out and "FAILED" not in out


def test_a_failed_trial_is_printed_and_exits_1(bench, monkeypatch, capsys):
    one_trial, calls = trials(bench, fail={("keep", 0.0)})
    assert run_main(bench, monkeypatch, one_trial) == 1
    out = capsys.readouterr().out
    assert "| 0 | keep | 0 | no trial succeeded |" in out
    assert "FAILED: 3 trial(s): keep, fraction 0, trial 1: RuntimeError: the update failed" in out
    # after each failure the engines are brought to the next version, and the next trial starts there
    assert bench.pushed == [0, 7, 13, 19]
    assert [v for *_, v in calls] == list(range(19))


def test_a_failed_warm_up_is_printed_and_exits_1(bench, monkeypatch, capsys):
    one_trial, calls = trials(bench, warm_up_fails=True)
    assert run_main(bench, monkeypatch, one_trial) == 1
    assert len(calls) == 19  # the trials still ran
    assert "FAILED: 1 trial(s): abort, fraction 0, warm-up: RuntimeError: 1 request(s) failed: boom" in (
        capsys.readouterr().out)
    assert bench.pushed == [0, 1]  # v0 before the warm-up; v1 after it failed


def test_a_missed_trigger_runs_the_batch_again_and_a_fifth_miss_fails_the_trial(bench, monkeypatch, capsys):
    one_trial, calls = trials(bench, misses=2)
    assert run_main(bench, monkeypatch, one_trial) == 0
    assert len(calls) == 1 + 2 + 18 and [v for *_, v in calls[:4]] == [0, 1, 1, 1]  # the same update again
    assert "batches run again because the update's trigger was missed (MissedWindow): 2" in capsys.readouterr().out
    one_trial, calls = trials(bench, misses=5)
    assert run_main(bench, monkeypatch, one_trial) == 1
    assert "wait, fraction 0.5, trial 1: MissedWindow: the batch ended" in capsys.readouterr().out
