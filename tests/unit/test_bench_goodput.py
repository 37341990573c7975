"""bench/goodput.py's pure part: run_from_dir reads a demo run's folder (daemon.log,
summary.json, dumps/*.jsonl, in the format the demo writes) into a goodput.Run whose figures
are known: a kill matched to its stop, a hang that no fault explains, a fault never injected,
a lost round, a sample at the wrong version and a partial output thrown away."""

from __future__ import annotations

import importlib.util
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from vime.harness.goodput import account

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_goodput", ROOT / "bench" / "goodput.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being built
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def at(t: float) -> str:
    return datetime.fromtimestamp(T0 + t, timezone.utc).isoformat().replace("+00:00", "Z")


def line(t: float, event: str, **fields) -> str:
    return json.dumps({**fields, "event": event, "level": "info", "timestamp": at(t)})


def tr(t: float, engine: str, frm: str, to: str, cause: str) -> str:
    return line(t, "engine.transition", engine=engine, from_state=frm, to_state=to, reason=cause, cause=cause,
                incarnation=1)


def sample(tokens: int, version: int, started_over: list[dict] | None = None) -> dict:
    return {"prompt": "p", "response": "r", "prompt_token_ids": [1], "output_token_ids": list(range(tokens)),
            "weight_version": version, "engine": "engine-1", "started_over": started_over or []}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "faults"
    (d / "dumps").mkdir(parents=True)
    log = [line(0, "supervisor.started", pid=1),
           *(tr(0.1, e, "STOPPED", "STARTING", "start") for e in ("engine-0", "engine-1")),
           *(tr(5, e, "STARTING", "RUNNING", "ready") for e in ("engine-0", "engine-1")),
           line(10, "round.start", round=1, routable=2),
           tr(12.5, "engine-0", "RUNNING", "EXITED", "exit"),          # the kill, injected at 12.0
           line(15, "round.end", round=1),
           tr(15.1, "engine-0", "EXITED", "STARTING", "restart"),
           tr(40, "engine-0", "STARTING", "RUNNING", "ready"),
           line(41, "round.start", round=2, routable=2),
           tr(43, "engine-1", "RUNNING", "UNHEALTHY", "hang"),         # no fault explains it
           line(45, "round.end", round=2),
           "Traceback (most recent call last): not JSON, skipped"]
    (d / "daemon.log").write_text("\n".join(log) + "\n")
    summary = {"steps": [{"step": 1, "round": 1, "lost": False, "tokens_regenerated": 3, "seconds": 20.0},
                         {"step": 2, "round": 2, "lost": True, "tokens_regenerated": 0, "seconds": 5.0}],
               "faults": [{"kind": "kill", "step": 1, "fired_step": 1, "engine": "engine-0",
                           "detected_after_s": 0.5, "note": ""},
                          {"kind": "push", "step": 9, "fired_step": None, "engine": None,
                           "detected_after_s": None, "note": "run too short"}],
               "stopped": None}
    (d / "summary.json").write_text(json.dumps(summary))
    head = {"format": "vime-rollout-dump", "version": 2, "rollout_id": 1, "weight_version": 1, "num_samples": 4}
    samples = [sample(5, 1), sample(7, 1, [{"engine": "engine-0", "weight_version": 1, "tokens": 3,
                                            "reason": "cut"}]), sample(4, 0)]
    (d / "dumps" / "1.jsonl").write_text("\n".join(json.dumps(x) for x in [head, *samples]) + "\n")
    return d


def test_a_run_folder_gives_the_known_figures(bench, run_dir):
    got = bench.read_dir(run_dir, target=2, name="faults")
    run = got.run
    assert [f.kind for f in run.faults] == ["kill"]
    assert run.faults[0].injected_at == pytest.approx(T0 + 12.0)
    assert any("push" in n and "not injected" in n for n in got.notes)
    assert run.useful_tokens == 12 and run.discarded_tokens == 4
    assert [o.tokens for o in run.started_over] == [3]
    assert run.wall_s == pytest.approx(25.0)

    row = account(run, fault_free_s=20.0)
    assert row.ettr == pytest.approx(0.8)
    assert row.faults == 1
    assert row.tokens_lost == 3 + 4
    assert (row.rounds, row.rounds_lost) == (2, 1)
    assert row.false_restarts == 1 and row.unmatched == []  # the hang; the kill matched its exit
    # engine-0 down 12.5..40, engine-1 down 43..45 (the window ends at the last round's end).
    assert row.reduced_s == pytest.approx(27.5 + 2.0)
    assert row.engines == 2
    assert row.useful_tps == pytest.approx(12 / 25)


def test_a_recorded_injection_time_is_used_as_is(bench, run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["faults"][0]["injected_at"] = T0 + 11.0
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert bench.run_from_dir(run_dir, target=2).faults[0].injected_at == T0 + 11.0


def test_a_fault_never_detected_stands_at_its_rounds_start(bench, run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["faults"][0]["detected_after_s"] = None
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert bench.run_from_dir(run_dir, target=2).faults[0].injected_at == pytest.approx(T0 + 10.0)


def test_a_folder_without_a_summary_is_an_error(bench, tmp_path):
    (tmp_path / "daemon.log").write_text("")
    with pytest.raises(OSError):
        bench.run_from_dir(tmp_path, target=2)


def test_quick_injects_every_fault_and_only_faulted_configs_get_fault_flags(bench):
    steps, at = bench.QUICK
    assert all(1 <= s <= steps for s in at.values())
    free = bench.loop_argv(bench.CONFIGS["fault-free"], steps, 0, at)
    spare = bench.loop_argv(bench.CONFIGS["spare"], steps, 0, at)
    assert free == ["--num-rollout", str(steps), "--seed", "0"]
    assert spare[:4] == free and {"--kill-at", "--hang-at", "--fail-push-at"} <= set(spare)
    assert bench.CONFIGS["spare"].target == bench.CONFIGS["faults"].target == 2


def test_gap_waits_are_the_seconds_from_a_publication_to_the_next_round(bench):
    evs = [{"event": "round_start", "ts": 1.0}, {"event": "round_end", "ts": 2.0},
           {"event": "weights_published", "ts": 3.0}, {"event": "round_start", "ts": 10.0},
           {"event": "round_end", "ts": 11.0}, {"event": "weights_published", "ts": 12.0},
           {"event": "round_start", "ts": 12.5}]
    assert bench.gap_waits(evs) == pytest.approx(7.0 + 0.5)
