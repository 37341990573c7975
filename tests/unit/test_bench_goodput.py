"""bench/goodput_real.py's pure part: run_from_dir reads a demo run's folder (daemon.log,
summary.json, dumps/*.jsonl, in the format the demo writes) into a goodput.Run whose figures
are known: a kill matched to its stop, a hang that no fault explains, a fault never injected,
a lost round, a sample at the wrong version and a partial output thrown away; a daemon killed
mid-round and a trainer killed mid-push. And the configurations' flags and the schedule."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from vime.harness.goodput import account

from support.bench_scripts import load_bench

T0 = 1_800_000_000.0


@pytest.fixture(scope="module")
def bench():
    return load_bench("goodput_real")


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


QUICK_FAULTS = ["--fault", "kill@1", "--fault", "hang@2", "--fault", "push@3", "--fault", "kill-gap@4",
                "--fault", "daemon@5"]


def test_each_configuration_gets_its_policy_and_the_same_schedule(bench):
    from vime.harness.chaos import KEEPER_KINDS, build_parser

    steps, at = bench.QUICK
    argv = {key: bench.loop_argv(cfg, steps, 0, at) for key, cfg in bench.CONFIGS.items()}
    common = ["--num-rollout", "6", "--seed", "0", "--long-tail", "4", "--long-tail-at", "1"]
    assert argv == {"fault-free": common, "slime": [*common, "--no-continue-partial", *QUICK_FAULTS],
                    "defaults": [*common, *QUICK_FAULTS], "spare": [*common, *QUICK_FAULTS]}
    # The demo's loop parser takes each of them as it is.
    parsed = {k: build_parser(KEEPER_KINDS).parse_args(["--model", "m", *a]) for k, a in argv.items()}
    assert [k for k, a in parsed.items() if not a.continue_partial] == ["slime"]
    assert "sent again whole (slime's behaviour" in " ".join(build_parser().format_help().split())
    assert parsed["fault-free"].fault is None
    assert parsed["slime"].fault == parsed["defaults"].fault == parsed["spare"].fault == sorted(
        at.items(), key=lambda kv: kv[1])
    assert all(a.long_tail == 4 and a.long_tail_at == at["kill"] for a in parsed.values())
    engines = {k: (c.engines, c.spares, c.target) for k, c in bench.CONFIGS.items()}
    assert engines == {"fault-free": (2, 0, 2), "slime": (2, 0, 2), "defaults": (2, 0, 2), "spare": (3, 1, 2)}
    demo = bench.demo_argv(bench.CONFIGS["spare"], Path("/r"), Path("/m"), argv["spare"])
    assert demo[demo.index("--engines") + 1] == "3" and demo[demo.index("--spares") + 1] == "1"
    assert demo[demo.index("--") + 1:] == argv["spare"]


def test_the_schedule_gives_each_fault_a_step_of_its_own(bench):
    from vime.harness.chaos import KEEPER_KINDS, parse_fault
    from vime.harness.faults import MID_PUSH

    (full_steps, full), (quick_steps, quick) = bench.FULL, bench.QUICK
    assert (full_steps, quick_steps) == (30, 6)
    assert full == {"kill": 3, "kill-gap": 6, "hang": 9, "push": 12, "daemon": 15, "kill-mid-push": 18,
                    "stop-mid-push": 21, "trainer-dies-mid-push": 24}
    assert quick == {"kill": 1, "hang": 2, "push": 3, "kill-gap": 4, "daemon": 5}
    assert set(full) == set(quick) | set(MID_PUSH)  # the mid-push faults in the full run only
    for steps, at in (bench.FULL, bench.QUICK):
        assert len(set(at.values())) == len(at)  # one fault a step
        assert max(at.values()) < steps  # a clean step after the last: its recovery is measured
        assert min(at, key=at.__getitem__) == "kill"  # the long-tail round first
        assert all(parse_fault(f"{k}@{s}", KEEPER_KINDS) == (k, s) for k, s in at.items())
    assert max(full, key=full.__getitem__) == "trainer-dies-mid-push"  # it restarts every receiver


def _readopted_run(d: Path) -> None:
    """A run folder with a daemon killed -9 mid-round (its engines re-adopted by the next one)
    and a trainer killed mid-push (both receivers condemned paused, restarted)."""
    (d / "dumps").mkdir(parents=True)
    log = [line(0, "supervisor.started", pid=1),
           *(tr(0.1, e, "STOPPED", "STARTING", "start") for e in ("engine-0", "engine-1")),
           *(tr(5, e, "STARTING", "RUNNING", "ready") for e in ("engine-0", "engine-1")),
           line(10, "round.start", round=1, routable=2),
           # the daemon killed at 12.0: its log ends; the next one starts 1 s later
           line(13.4, "journal.restored", round=1, round_open=True, adopted=["engine-0", "engine-1"]),
           line(13.5, "supervisor.started", pid=2),
           *(tr(13.5, e, "STOPPED", "STARTING", "restored") for e in ("engine-0", "engine-1")),
           *(tr(13.7, e, "STARTING", "RUNNING", "ready") for e in ("engine-0", "engine-1")),
           line(15, "round.end", round=1),
           line(16, "weights.published", version=1),
           line(17, "round.start", round=2, routable=2),
           line(20, "round.end", round=2),
           # the trainer's push killed at 21.0; both receivers paused past its deadline at 30
           *(tr(30, e, "RUNNING", "UNHEALTHY", "paused") for e in ("engine-0", "engine-1")),
           *(tr(30.1, e, "UNHEALTHY", "STOPPING", "paused") for e in ("engine-0", "engine-1")),
           *(tr(30.5, e, "STOPPING", "EXITED", "paused") for e in ("engine-0", "engine-1")),
           *(tr(31, e, "EXITED", "STARTING", "restart") for e in ("engine-0", "engine-1")),
           tr(60, "engine-0", "STARTING", "RUNNING", "ready"), tr(62, "engine-1", "STARTING", "RUNNING", "ready"),
           line(63, "round.start", round=3, routable=2),
           line(70, "round.end", round=3)]
    (d / "daemon.log").write_text("\n".join(log) + "\n")
    dies = [{"kind": "trainer-dies-mid-push", "step": 2, "fired_step": 2, "engine": e, "injected_at": T0 + 21.0,
             "detected_after_s": 9.0, "note": ""} for e in ("engine-0", "engine-1")]
    summary = {"steps": [{"step": n, "round": n, "lost": False, "tokens_regenerated": 0, "seconds": 10.0}
                         for n in (1, 2, 3)],
               "faults": [{"kind": "daemon", "step": 1, "fired_step": 1, "engine": "daemon",
                           "injected_at": T0 + 12.0, "detected_after_s": 1.6, "note": ""}, *dies],
               "stopped": None}
    (d / "summary.json").write_text(json.dumps(summary))


def test_a_daemon_kill_and_a_trainer_dead_mid_push_give_the_known_figures(bench, tmp_path):
    _readopted_run(tmp_path / "run")
    run = bench.run_from_dir(tmp_path / "run", target=2, name="defaults")
    assert [(f.kind, f.engine) for f in run.faults] == [
        ("daemon", "daemon"), ("trainer-dies-mid-push", "engine-0"), ("trainer-dies-mid-push", "engine-1")]
    row = account(run, fault_free_s=30.0)
    assert row.faults == 2  # the trainer's death is one fault, whatever receivers it condemned
    # The re-adoption is no stop, each paused receiver matches its own fault.
    assert row.false_restarts == 0 and row.unmatched == []
    # Nothing served below target across the daemon's restart; both receivers down 30..60, one to 62.
    assert row.reduced_s == pytest.approx(32.0)
    assert row.reduced_s_per_fault == pytest.approx(16.0)
    assert row.engines == 2 and row.ettr == pytest.approx(1.0)


def test_read_finds_a_former_benchs_folder_for_todays_defaults(bench, run_dir, tmp_path, capsys):
    assert run_dir.name == "faults"  # what the former bench called today's defaults
    out = tmp_path / "rows.json"
    assert bench.main(["--read", str(run_dir.parent), "--only", "defaults", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["rows"]] == ["today's defaults"] and doc["errors"] == {}
    assert "today's defaults" in capsys.readouterr().out


def test_only_takes_the_short_names(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--read", str(tmp_path), "--only", "faults, warm spare", "--out", str(tmp_path / "x.json")])


def test_gap_waits_are_the_seconds_from_a_publication_to_the_next_round(bench):
    evs = [{"event": "round_start", "ts": 1.0}, {"event": "round_end", "ts": 2.0},
           {"event": "weights_published", "ts": 3.0}, {"event": "round_start", "ts": 10.0},
           {"event": "round_end", "ts": 11.0}, {"event": "weights_published", "ts": 12.0},
           {"event": "round_start", "ts": 12.5}]
    assert bench.gap_waits(evs) == pytest.approx(7.0 + 0.5)
