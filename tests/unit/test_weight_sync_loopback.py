"""weight_sync's wire format and sender, without a vLLM engine (seconds, no model).

The receiver is `weight_sync.loopback`: the real GlooWeightTransferEngine receive path behind
vLLM's HTTP routes, with a model stub that keeps what it receives, so every byte can be checked.
"""

from __future__ import annotations

import time

import pytest
import torch

from vime.weight_sync.broadcast import push_to_many
from vime.weight_sync.errors import PoisonedEngine, WeightSyncError
from vime.weight_sync.packing import iter_buckets, plan_update, unpack_bucket
from vime.weight_sync.sender import WeightSender


def mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(33, 7, generator=g)),                       # odd byte count
        ("b.scale", torch.tensor(3.5)),                                       # 0-d
        ("c.half", torch.randn(5, 3, generator=g).to(torch.bfloat16)),        # 2-byte, misaligning
        ("d.int8", torch.randint(-100, 100, (13,), generator=g, dtype=torch.int8)),
        ("e.empty", torch.empty(0, 4)),
        ("f.big", torch.randn(300, 300, generator=g)),                        # > a small bucket
        ("g.noncontig", torch.randn(40, 30, generator=g).t()),
        ("h.double", torch.randn(9, generator=g, dtype=torch.float64)),
    ]


@pytest.mark.parametrize("bucket_bytes", [0, 1, 1024, 64 << 10, 64 << 20])
def test_plan_pack_unpack_roundtrip(bucket_bytes):
    pairs = mixed_tensors()
    plan = plan_update([(n, t.dtype, t.shape) for n, t in pairs], bucket_bytes)
    info = plan.update_info()
    bufs = list(iter_buckets(plan, (t for _, t in pairs)))
    if bucket_bytes <= 0:
        assert "buckets" not in info and len(bufs) == len(pairs)
        return
    assert sum(plan.buckets) == len(pairs) and len(bufs) == len(plan.buckets)
    if bucket_bytes >= 64 << 20:
        assert plan.buckets == [len(pairs)]
    got, i = [], 0
    for count, buf in zip(plan.buckets, bufs):
        assert buf.numel() <= max(bucket_bytes, max(
            t.numel() * t.element_size() for _, t in pairs[i:i + count]))
        got += unpack_bucket(buf, plan.names[i:i + count],
                             [getattr(torch, d) for d in plan.dtype_names[i:i + count]],
                             plan.shapes[i:i + count], plan.bucket_align)
        i += count
    for (n, t), (gn, gt) in zip(pairs, got):
        assert n == gn and gt.dtype == t.dtype and gt.shape == t.shape and torch.equal(gt, t)


@pytest.fixture
def loopback():
    pytest.importorskip("vllm")
    from vime.harness.loopback import LoopbackEngine

    eng = LoopbackEngine(keep=True)
    yield eng
    eng.close()


@pytest.mark.parametrize("bucket_bytes", [0, 4096])
def test_push_delivers_every_byte_and_reuses_group(loopback, bucket_bytes):
    pairs = mixed_tensors()
    with WeightSender(loopback.url, bucket_bytes=bucket_bytes, transfer_timeout=30) as s:
        r1 = s.push(pairs, 1)
        assert r1.ok and r1.group_inits == 1 and loopback.version == "1"
        got = dict(loopback.received)
        assert set(got) == {n for n, _ in pairs}
        for n, t in pairs:
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
        loopback.received.clear()
        r2 = s.push([(n, t + 1) if t.is_floating_point() else (n, t) for n, t in pairs], 2)
        assert r2.ok and r2.group_inits == 0 and loopback.version == "2"
        assert torch.equal(dict(loopback.received)["a.weight"], pairs[0][1] + 1)
    expected = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                "/resume", "/weight_info"]
    calls = loopback.calls
    assert calls[:2] == ["/get_world_size", "/init_weight_transfer_engine"]
    assert calls[2:8] == expected and calls[8:14] == expected
    assert calls[-1] == "/shutdown_weight_transfer_engine"


def test_reinit_after_engine_lost_the_group(loopback):
    """A restarted engine has no group: it refuses start before touching the model; the sender
    re-inits once and goes on."""
    with WeightSender(loopback.url, transfer_timeout=30) as s:
        assert s.push(mixed_tensors(), 1).ok
        loopback.engine.shutdown()  # as if restarted
        r = s.push(mixed_tensors(), 2)
        assert r.ok and r.group_inits == 1 and s.group_inits == 2


def test_failure_mid_transfer_poisons_and_the_receiver_fails_fast(loopback):
    def boom(step, info):
        if step == "bucket_sent" and info["index"] == 1:
            raise RuntimeError("injected")

    s = WeightSender(loopback.url, bucket_bytes=1024, transfer_timeout=60, progress=boom)
    with pytest.raises(PoisonedEngine) as exc:
        s.push(mixed_tensors(), 1)
    assert exc.value.step == "update_weights" and "injected" in str(exc.value.cause)
    assert not s.has_group
    # The receiver notices the closed connection (not after its 60 s timeout) and is poisoned.
    deadline = time.monotonic() + 5
    while loopback.engine.poisoned is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loopback.engine.poisoned and "by peer" in loopback.engine.poisoned
    s.progress = None
    with pytest.raises(PoisonedEngine) as exc:
        s.push(mixed_tensors(), 2)
    assert exc.value.step == "init_weight_transfer_engine"


def test_push_to_many_reports_per_engine(loopback):
    from vime.harness.local_daemon import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    res = push_to_many([loopback.url, dead], mixed_tensors(), 7, http_timeout=5)
    assert res[loopback.url].ok and loopback.version == "7"
    assert not res[dead].ok and isinstance(res[dead].error, WeightSyncError)
    assert not res[dead].poisoned and res[dead].error.step == "get_world_size"


@pytest.mark.parametrize("where", ["parse", "load"])
def test_engine_side_failure_fails_the_sender_fast(loopback, where):
    """The engine rejects the update (bad update_info) or fails loading mid-transfer: the sender
    is blocked sending, and must learn it from the closed connection / the 500, not a timeout."""
    def fail(*_a):
        raise RuntimeError(f"engine-side {where} failure")

    if where == "parse":
        loopback.engine.parse_update_info = fail
    else:
        loopback.engine.model.load_weights = fail
    pairs = [(f"w{i}", torch.randn(512, 1024)) for i in range(8)]  # 2 MiB each: solo buckets
    s = WeightSender(loopback.url, bucket_bytes=1 << 20, transfer_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(PoisonedEngine) as exc:
        s.push(pairs, 1)
    assert time.monotonic() - t0 < 15
    assert exc.value.step == "update_weights" and not s.has_group
    if where == "load":  # the reload had begun: half-loaded
        assert f"engine-side {where} failure" in loopback.engine.poisoned
    else:  # rejected before the reload began: the model is untouched, the session over
        assert loopback.engine.poisoned is None and loopback.engine.reloads_begun == 0
        assert not loopback.engine._in_session and loopback.engine.group is None


def test_nccl_backend_on_cpu_fails_cleanly_before_start(loopback):
    """backend="nccl" is for GPU hosts (untested here); on CPU it must fail at init, cleanly."""
    s = WeightSender(loopback.url, backend="nccl", http_timeout=10, transfer_timeout=20)
    with pytest.raises(WeightSyncError) as exc:
        s.push([("a", torch.ones(3))], 1)
    assert not isinstance(exc.value, PoisonedEngine)
    assert exc.value.step == "init_weight_transfer_engine"
    assert "/start_weight_update" not in loopback.calls


def test_plugin_register_is_light_and_idempotent():
    import subprocess
    import sys

    # Outside vLLM: importing and calling it pulls in neither torch nor vLLM.
    code = ("import sys, weight_sync, vime.weight_sync.vllm_plugin as p; p.register(); p.register(); "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
    # Inside vLLM (as load_general_plugins does, possibly more than once): both names registered.
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vime.weight_sync.gloo_engine import GlooWeightTransferEngine
    from vime.weight_sync.vllm_plugin import register

    register()
    register()
    for name in ("gloo", "vime_gloo"):
        assert WeightTransferEngineFactory._registry[name]() is GlooWeightTransferEngine


@pytest.mark.parametrize("tensors, said", [
    ({"w": torch.eye(3).to_sparse()}, "push dense tensors"),
    ({"w": torch.empty(4, device="meta")}, "meta device"),
    ({}, "no tensors to push"),
    ({"w": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)}, "quantized"),
    ({"w": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, "nested tensor"),
])
def test_a_set_no_engine_could_load_is_refused_before_any_engine_is_contacted(tensors, said):
    # No engine runs at this URL: a refusal that came after a call would say it is unreachable.
    from vime.weight_sync.broadcast import FleetSender

    with pytest.raises(ValueError, match=said):
        WeightSender("http://127.0.0.1:9").push(tensors, 1)
    with FleetSender() as fs, pytest.raises(ValueError, match=said):
        fs.push(["http://127.0.0.1:9"], tensors, 1)
