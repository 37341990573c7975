"""trainer/rl_loop.py asks the daemon's [weights] mode (its status answer over the control
socket) before it loads the model: --async against a daemon in sync mode, and the round loop
against one in async mode, are refused at once (exit 2, one line with what to set). A real
daemon process over one PROTOCOL STAND-IN engine (tests/support/standin_group.py; not vLLM:
no weights are loaded or pushed here).

The --model given is a folder with a config.json and nothing else: a load would fail with a
Hugging Face error, so the mode's refusal shows that nothing was loaded before it."""

from __future__ import annotations

import time

import pytest

from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config, standin_model, standin_python
from vime.supervisor.client import SupervisorClient
from vime.trainer import rl_loop

from support.standins import STANDIN_GROUP


def start(tmp, weights: dict | None) -> Daemon:
    tmp.mkdir()
    python = standin_python(tmp, STANDIN_GROUP)
    model = standin_model(tmp / "model")
    engines = [{"name": "e0", "model": str(model), "served_model_name": "tiny", "port": free_port()}]
    d = Daemon(standin_config(tmp, python, engines, **({"weights": weights} if weights else {})))
    d.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
    return d


@pytest.fixture
def unloadable(tmp_path):
    m = tmp_path / "policy"
    m.mkdir()
    (m / "config.json").write_text("{}")
    return m


@pytest.mark.parametrize("weights, flags, says", [
    (None, ["--async"], 'set [weights] mode = "async" and max_staleness = 1'),
    ({"mode": "async", "max_staleness": 0}, ["--async"], "set [weights] max_staleness = 1 (or more)"),
    ({"mode": "async", "max_staleness": 1}, [], 'add --async, or set [weights] mode = "sync"'),
])
def test_a_loop_the_daemons_mode_cannot_serve_is_refused_before_the_model_loads(tmp_path, unloadable, capsys,
                                                                                 weights, flags, says):
    d = start(tmp_path / "d", weights)
    try:
        sock = str(tmp_path / "d" / "run" / "supervisor.sock")
        before = SupervisorClient(sock).status()
        t0 = time.monotonic()
        rc = rl_loop.main(["--model", str(unloadable), "--socket", sock, "--out", str(tmp_path / "out"), *flags])
        took = time.monotonic() - t0
        err = capsys.readouterr().err
        assert rc == 2 and says in err, err
        assert err.count("\n") == 1 and err.startswith("rl_loop: "), err  # one line, no traceback
        print(f"\nrefused in {took:.2f}s")
        after = SupervisorClient(sock).status()
        assert (after["round"], after["weight_version"]) == (before["round"], before["weight_version"])
    finally:
        kill_all([d])


def test_the_round_loop_may_roll_out_only_against_an_async_daemon():
    """--debug-rollout-only trains nothing: no on-policy round is claimed, so async mode serves it."""
    rule = rl_loop.VersionRule(rl_loop.WeightsMode.ASYNC, 1)
    assert rl_loop.mode_refusal(rule, False, trains=False) is None
    assert rl_loop.mode_refusal(rule, True) is None
