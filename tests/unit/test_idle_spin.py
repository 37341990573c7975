"""VIME_VLLM_IDLE_SPIN_S, applied by our vLLM plugin to vLLM's own SpinCondition (in a process
that imported vLLM and then loaded the plugin, as vLLM's plugin loader does in each engine process). What it saves, measured
on real engines (`bench/idle_spin.py`), is in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vime.weight_sync.vllm_plugin import spin_seconds

# One interpreter imports vLLM (about 13 s here), then forks a child per case: each child is a
# process in which vLLM was imported and our plugin then loaded, as in an engine process.
CASES = {"bounded": ("0.05", False), "unset": (None, False), "bad": ("soon", False), "wrapped": ("0.05", True)}
CHECK = """
import functools, json, os, sys
import vllm, zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition as C
import vllm.distributed.weight_transfer.factory  # what register() imports: once, before the forks
tmp, cases = sys.argv[1], json.loads(sys.argv[2])
for name, (value, wrapped) in cases.items():
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.path.join(tmp, name + ".err"), os.O_WRONLY | os.O_CREAT), 2)
        if value is not None:
            os.environ["VIME_VLLM_IDLE_SPIN_S"] = value
        seen = []
        if wrapped:  # another plugin's wrapper, installed before ours
            inner = C.__init__
            @functools.wraps(inner)
            def theirs(self, *a, **k):
                seen.append(1)
                inner(self, *a, **k)
            C.__init__ = theirs
        from vime.weight_sync import vllm_plugin as p
        p.register(); p.register()  # vLLM loads plugins more than once per process
        ctx = zmq.Context()
        made = C(is_reader=True, context=ctx, notify_address="ipc://" + os.path.join(tmp, name))
        given = C(True, ctx, "ipc://" + os.path.join(tmp, name + "2"), 3.0)
        print("CASE " + json.dumps([name, made.busy_loop_s, given.busy_loop_s, len(seen)]), flush=True)
        os._exit(0)
    print("EXIT " + json.dumps([name, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])]), flush=True)
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[list, str]]:
    """Each case's [busy_loop_s made with vLLM's default, busy_loop_s given, calls of another
    plugin's wrapper] and its stderr."""
    tmp = tmp_path_factory.mktemp("spin")
    env = {k: v for k, v in os.environ.items() if k != "VIME_VLLM_IDLE_SPIN_S"}
    out = subprocess.run([sys.executable, "-c", CHECK, str(tmp), json.dumps(CASES)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    rows = {r[0]: r[1:] for r in (json.loads(x[5:]) for x in lines if x.startswith("CASE "))}
    exits = dict(json.loads(x[5:]) for x in lines if x.startswith("EXIT "))
    errs = {name: (tmp / f"{name}.err").read_text() if (tmp / f"{name}.err").exists() else "" for name in CASES}
    for name in CASES:  # a child that died says why (its stderr went to its own file)
        assert exits.get(name) == 0 and name in rows, f"{name}: exit {exits.get(name)}\n{errs[name][-2000:]}"
    return {name: (rows[name], errs[name]) for name in CASES}


def test_the_bound_replaces_vllms_default_and_unset_leaves_it(cases):
    assert cases["bounded"][0] == [0.05, 3.0, 0], cases["bounded"][1][-2000:]  # a busy_loop_s vLLM passes itself is kept
    assert cases["unset"][0] == [1, 3.0, 0], cases["unset"][1][-2000:]


def test_a_bad_value_in_a_hand_started_engine_is_said_and_vllms_spin_kept(cases):
    got, err = cases["bad"]
    assert got == [1, 3.0, 0], err[-2000:]
    assert "VIME_VLLM_IDLE_SPIN_S='soon'" in err and "spin is left unchanged" in err


def test_another_plugins_wrapper_is_kept(cases):
    # ours wraps theirs, and each of the two SpinConditions went through theirs
    assert cases["wrapped"][0] == [0.05, 3.0, 2], cases["wrapped"][1][-2000:]


@pytest.mark.parametrize("value,expected", [("", None), (" 0 ", 0.0), ("0.25", 0.25), ("1", 1.0)])
def test_values(value, expected):
    assert spin_seconds(value) == expected


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-0.1", "1s", "1.5", "\uff11", "\u0661"])
def test_refused(value):
    with pytest.raises(ValueError, match="VIME_VLLM_IDLE_SPIN_S"):
        spin_seconds(value)


def test_a_huge_value_is_not_echoed_whole():
    with pytest.raises(ValueError) as e:
        spin_seconds("9" * 200_000)
    assert len(str(e.value)) < 300
