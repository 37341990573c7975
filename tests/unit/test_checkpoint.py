"""vime.weight_sync.checkpoint without an engine: save, validate, and reload's HTTP sequence.

reload_from_checkpoint's real behaviour against vLLM is in tests/engine/test_weight_sync_real.py; here
a recording stub HTTP server checks what it sends, and that an invalid checkpoint never reaches
the engine at all.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vime.harness.local_daemon import free_port
from vime.weight_sync.checkpoint import reload_from_checkpoint, save_checkpoint, validate_checkpoint
from vime.weight_sync.errors import CheckpointError, PoisonedEngine, WeightSyncError


@pytest.fixture
def ckpt(tiny_model, tmp_path):
    """A copy of the tiny model directory we may damage."""
    return shutil.copytree(tiny_model, tmp_path / "ckpt")


def test_valid_checkpoint_passes_and_returns_config(ckpt, tiny_model):
    cfg = validate_checkpoint(ckpt, expect_config=tiny_model)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 128


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nope does not exist"):
        validate_checkpoint(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        validate_checkpoint(tmp_path / "f")


def test_no_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors weight files"):
        validate_checkpoint(ckpt)


def test_no_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        validate_checkpoint(ckpt)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        validate_checkpoint(ckpt)


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or padded safetensors file"):
        validate_checkpoint(ckpt)


def test_missing_shard_named_in_index(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="shards missing.*model-00002-of-00002"):
        validate_checkpoint(ckpt)


@pytest.mark.parametrize("key,value", [("hidden_size", 256), ("architectures", ["MistralForCausalLM"]),
                                       ("num_hidden_layers", 3)])
def test_config_mismatch(ckpt, tiny_model, key, value):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"does not match the served model: {key}: checkpoint"):
        validate_checkpoint(ckpt, expect_config=tiny_model)
    # accepted as a dict or a config.json path too
    with pytest.raises(CheckpointError, match=key):
        validate_checkpoint(ckpt, expect_config=tiny_model / "config.json")
    validate_checkpoint(ckpt)  # without a reference it is a fine checkpoint


def test_save_checkpoint_is_complete_and_atomic(tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    out = tmp_path / "ckpts" / "step-1"
    out.mkdir(parents=True)
    (out / "stale.safetensors").write_text("left over from an older save")
    assert save_checkpoint(model, tiny_model, out) == out.resolve()
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "stale.safetensors" not in names  # replaced as a whole, not merged
    assert [p.name for p in out.parent.iterdir()] == ["step-1"]  # no temporary left behind
    validate_checkpoint(out, expect_config=tiny_model)
    sd = load_file(out / "model.safetensors")
    assert torch.equal(sd["model.norm.weight"], model.model.norm.weight)


class Recorder:
    """A stub engine that records requests; /collective_rpc answers `rpc_status`."""

    def __init__(self, rpc_status=200):
        self.requests: list[tuple[str, dict | None]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _do(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                outer.requests.append((self.path, body))
                if self.path.startswith("/update_weight_version"):
                    outer.version = body["new_version"]
                status, out = 200, {}
                if self.path == "/collective_rpc":
                    status = rpc_status
                    out = {"results": [None]} if status == 200 else {"error": {"message": "boom"}}
                if self.path == "/weight_info":
                    out = {"weight_version": getattr(outer, "version", "default")}
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _do

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self):
        return [p.split("?")[0] for p, _ in self.requests]


def test_reload_invalid_checkpoint_never_contacts_the_engine(tmp_path):
    rec = Recorder()
    try:
        with pytest.raises(CheckpointError, match="does not exist"):
            reload_from_checkpoint(rec.url, tmp_path / "missing", 3)
        assert rec.requests == []
    finally:
        rec.server.shutdown()


def test_reload_sequence_and_poison_on_rpc_failure(ckpt, monkeypatch):
    rec = Recorder()
    try:
        monkeypatch.chdir(ckpt.parent)
        steps = reload_from_checkpoint(rec.url, "ckpt", 5)  # relative: sent as absolute
        assert rec.paths() == ["/pause", "/collective_rpc", "/update_weight_version", "/resume",
                               "/weight_info"]
        assert rec.requests[0][0] == "/pause?mode=abort"
        assert rec.requests[1][1]["method"] == "reload_weights"
        assert rec.requests[1][1]["kwargs"] == {"weights_path": str(ckpt.resolve())}
        assert rec.requests[2][1] == {"new_version": "5"}
        assert set(steps) >= {"validate", "pause", "reload_weights", "resume"}
    finally:
        rec.server.shutdown()

    bad = Recorder(rpc_status=500)
    try:
        with pytest.raises(PoisonedEngine) as exc:
            reload_from_checkpoint(bad.url, ckpt, 6)
        assert exc.value.step == "reload_weights" and exc.value.url == bad.url
        assert bad.paths() == ["/pause", "/collective_rpc"]  # left paused: no /resume
    finally:
        bad.server.shutdown()


def test_reload_unreachable_engine_is_not_poison(ckpt):
    with pytest.raises(WeightSyncError) as exc:
        reload_from_checkpoint(f"http://127.0.0.1:{free_port()}", ckpt, 1, http_timeout=3)
    assert not isinstance(exc.value, PoisonedEngine) and exc.value.step == "pause"
