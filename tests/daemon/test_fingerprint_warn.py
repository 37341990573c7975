"""fingerprint_mismatch = "warn", with a PROTOCOL STAND-IN engine (support/standin_versioned.py:
/weight_info says what its version file says; its completions carry no logprobs, so it cannot
show a fingerprint): the mismatch is logged and counted, and the engine stays routed as its
label says. The other two modes are on real engines (tests/engine/test_fingerprint_real.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest

from vime.harness.local_daemon import Daemon, free_port, standin_python, write_config
from vime.supervisor.client import BadRequest, ConflictError, SupervisorClient
from vime.supervisor.engine import fingerprint as F

from support.polling import wait_until
from support.standins import STANDIN_VERSIONED

FP = {"prompts": [[1, 2, 3]], "logprobs": [[-1.0, -2.0]], "tolerance": 1e-4}


def test_warn_counts_the_mismatch_and_keeps_routing(tmp_path):
    version_file = tmp_path / "version"
    version_file.write_text("1")  # the label a push would set
    standin = standin_python(tmp_path, STANDIN_VERSIONED)
    port, metrics = free_port(), f"127.0.0.1:{free_port()}"
    engine = subprocess.Popen([str(standin), "--port", str(port)],
                              env={**os.environ, "STANDIN_VERSION_FILE": str(version_file)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg = write_config(tmp_path / "supervisor.toml",
                       supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"),
                                   "fingerprint_mismatch": "warn", "metrics_address": metrics},
                       health_check={"first_wait": 30.0, "interval": 1.0, "timeout": 1.0},
                       engines=[{"name": "e", "url": f"http://127.0.0.1:{port}"}])
    d = Daemon(cfg)
    try:
        client = SupervisorClient(str(tmp_path / "run" / "supervisor.sock"))
        d.transition("e", "RUNNING", 30)
        mark = d.mark()
        reply = client.publish_weights(1, fingerprint=FP)
        assert "outputs not matching the fingerprint (warn): e: fingerprint not computed" in reply["message"]
        assert [x["name"] for x in client.routable_engines()["engines"]] == ["e"]  # warn: routed
        warned = d.wait_for(lambda ev: ev.get("event") == "fingerprint.mismatch", 10, after=mark)
        assert warned["action"] == "warn" and warned["engine"] == "e"
        assert not [ev for ev in d.events[mark:] if ev.get("event") == "engine.transition"]

        def scraped() -> str:
            with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as r:
                return r.read().decode()
        assert 'vime_fingerprint_mismatches_total{at="publish"} 1.0' in wait_until(scraped, 10)

        # The current version again: with the same fingerprint or none, a no-op; with another
        # one, refused (the engine routed at it was checked against the first), which stays.
        assert client.publish_weights(1, fingerprint=FP)["changed"] is False
        assert client.publish_weights(1)["changed"] is False
        with pytest.raises(ConflictError, match="already current with another fingerprint.*publish a new version"):
            client.publish_weights(1, fingerprint={**FP, "logprobs": [[-1.0, -3.0]]})
        time.sleep(0.5)  # past the journal's coalescing (0.1 s): a replaced fingerprint would be written by now
        journal = json.loads((tmp_path / "state" / "journal.json").read_text())
        assert journal["weight_fingerprint"] == {"version": 1, **FP}

        # The largest fingerprint the parser allows goes through the socket's body cap; one
        # over it (16 prompts of 256 tokens) is refused with the limit and what to send.
        worst = -2.2250738585072014e-308  # the longest JSON a finite float has
        big = {"prompts": [[F.MAX_TOKEN_ID] * F.MAX_PROMPT_TOKENS] * F.MAX_PROMPTS,
               "logprobs": [[worst] * (F.MAX_PROMPT_TOKENS - 1)] * F.MAX_PROMPTS, "tolerance": 1e-4}
        assert client.publish_weights(2, fingerprint=big)["changed"] is True
        over = {"prompts": [[F.MAX_TOKEN_ID] * 256] * 16, "logprobs": [[worst] * 255] * 16, "tolerance": 1e-4}
        with pytest.raises(BadRequest, match=r"request body over 65536 bytes .*at most 8 prompts of 128 token ids"
                                             r".*send fewer or shorter prompts") as ei:
            client.publish_weights(3, fingerprint=over)
        assert ei.value.status == 413
    finally:
        d.terminate(20)
        engine.terminate()
        engine.wait(10)
