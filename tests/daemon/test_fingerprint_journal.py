"""The journal keeps the current version's fingerprint: a daemon killed (SIGKILL) and started
again still checks an engine by what it computes as it re-attaches, not by its label; and a
journal an older daemon wrote (no fingerprint) still loads. With a PROTOCOL STAND-IN engine
(support/standin_versioned.py: /weight_info says what its version file says, the label a
hand-called /update_weight_version sets; its completions carry no prompt logprobs, so it can
never show the fingerprint). That a real engine holding the version's weights passes the
check after a daemon restart is tests/engine/test_fingerprint_real.py's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from vime.harness.local_daemon import Daemon, free_port, standin_python, write_config
from vime.supervisor.client import SupervisorClient

from support.polling import wait_until
from support.routable import RoutableSampler
from support.standins import STANDIN_VERSIONED

FP = {"prompts": [[1, 2, 3]], "logprobs": [[-1.0, -2.0]], "tolerance": 1e-4}


def attached_standin(tmp_path: Path, version: str):
    """A versioned stand-in engine at `version` (its label in a file the test may rewrite), and a
    daemon config attaching it as "e": (version file, engine process, config, socket, journal)."""
    version_file = tmp_path / "version"
    version_file.write_text(version)
    standin = standin_python(tmp_path, STANDIN_VERSIONED)
    port = free_port()
    engine = subprocess.Popen([str(standin), "--port", str(port)],
                              env={**os.environ, "STANDIN_VERSION_FILE": str(version_file)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg = write_config(tmp_path / "supervisor.toml",
                       supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs")},
                       health_check={"first_wait": 30.0, "interval": 0.5, "timeout": 1.0, "success_threshold": 1},
                       engines=[{"name": "e", "url": f"http://127.0.0.1:{port}"}])
    return version_file, engine, cfg, str(tmp_path / "run" / "supervisor.sock"), tmp_path / "state" / "journal.json"


def test_a_restarted_daemon_checks_a_reattached_engine_by_the_journaled_fingerprint(tmp_path):
    version_file, engine, cfg, sock, journal = attached_standin(tmp_path, "0")
    daemons: list[Daemon] = []
    try:
        d1 = Daemon(cfg)
        daemons.append(d1)
        d1.transition("e", "RUNNING", 30)
        reply = SupervisorClient(sock).publish_weights(1, fingerprint=FP)  # e is behind (v0): STALE
        assert "stale (not routable until synced): e" in reply["message"]
        d1.transition("e", "STALE", 10)
        kept = json.loads(journal.read_text())
        assert kept["weight_version"] == 1 and kept["weight_fingerprint"] == {"version": 1, **FP}
        d1.proc.kill()  # SIGKILL: nothing but the journal survives
        d1.proc.wait(10)
        version_file.write_text("1")  # the label set by hand: the label check alone would pass

        d2 = Daemon(cfg)
        daemons.append(d2)
        sampler = RoutableSampler(sock)
        try:
            restored = d2.wait_for(lambda ev: ev.get("event") == "journal.restored", 30)
            assert restored["weight_version"] == 1 and restored["fingerprint"] is True
            caught = d2.wait_for(lambda ev: ev.get("event") == "fingerprint.mismatch", 30)
            assert (caught["engine"], caught["at"], caught["action"]) == ("e", "ready", "poison")
            down = d2.transition("e", "UNHEALTHY", 10)
            assert down["cause"] == "fingerprint_mismatch"
            assert down["reason"].startswith("poisoned: /weight_info says v1, but fingerprint not computed")
            # Attached: it answers its probes again and is checked again each time, never routed.
            second = d2.mark()
            d2.wait_for(lambda ev: ev.get("event") == "fingerprint.mismatch", 30, after=second)
            # Read after the re-attach too, when the label check alone routes it (the mutation below).
            taken = len(sampler.samples)
            wait_until(lambda: len(sampler.samples) >= taken + 3, 30)
        finally:
            samples = sampler.stop()
        assert all(s == [] for s in samples), [s for s in samples if s]
        assert not [ev for ev in d2.events if ev.get("event") == "engine.transition"
                    and ev.get("to_state") in ("RUNNING", "SUSPECT")]

        # The mutation, and an older daemon's journal: without the field it loads, and the same
        # engine is routed on its label alone.
        d2.proc.kill()
        d2.proc.wait(10)
        old = json.loads(journal.read_text())
        assert old.pop("weight_fingerprint")["version"] == 1
        journal.write_text(json.dumps(old))
        d3 = Daemon(cfg)
        daemons.append(d3)
        restored = d3.wait_for(lambda ev: ev.get("event") == "journal.restored", 30)
        assert restored["weight_version"] == 1 and restored["fingerprint"] is False
        d3.transition("e", "RUNNING", 30)
        assert [x["name"] for x in SupervisorClient(sock).routable_engines()["engines"]] == ["e"]
    finally:
        for d in daemons:
            d.terminate(20)
        engine.terminate()
        engine.wait(10)


def test_a_bad_journaled_fingerprint_is_dropped_alone(tmp_path):
    """A journal whose weight_fingerprint is malformed, or names another version than
    weight_version (a hand edit): only the fingerprint is dropped, with a warning that says what
    to do; the round and version are kept (the checkpoint with them) and the engine is routed on its label."""
    version_file, engine, cfg, sock, journal = attached_standin(tmp_path, "1")
    daemons: list[Daemon] = []
    try:
        d = Daemon(cfg)
        daemons.append(d)
        d.transition("e", "RUNNING", 30)
        SupervisorClient(sock).start_round(3)
        SupervisorClient(sock).end_round(3)
        SupervisorClient(sock).publish_weights(1, fingerprint=FP)
        wait_until(lambda: json.loads(journal.read_text()).get("weight_fingerprint") is not None, 10)
        for bad in ("abc", {"version": 8, **FP}):
            d.proc.kill()
            d.proc.wait(10)
            data = json.loads(journal.read_text())
            assert data["weight_version"] == 1 and data["round"] == 3
            data["weight_fingerprint"] = bad
            journal.write_text(json.dumps(data))
            d = Daemon(cfg)
            daemons.append(d)
            restored = d.wait_for(lambda ev: ev.get("event") == "journal.restored", 30)
            assert (restored["weight_version"], restored["round"], restored["round_open"]) == (1, 3, False)
            assert restored["fingerprint"] is False
            dropped = [ev for ev in d.events if ev.get("event") == "journal.fingerprint_dropped"]
            assert len(dropped) == 1 and "publishes the current version again" in dropped[0]["action"]
            assert not [ev for ev in d.events if ev.get("event") == "journal.unusable"]
            assert not list(journal.parent.glob("journal.json.corrupt-*"))
            assert SupervisorClient(sock).status()["weight_version"] == 1
            d.transition("e", "RUNNING", 30)
            assert [x["name"] for x in SupervisorClient(sock).routable_engines()["engines"]] == ["e"]
    finally:
        for d in daemons:
            d.terminate(20)
        engine.terminate()
        engine.wait(10)
