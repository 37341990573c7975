"""Which vLLM trainer API the NCCL push calls (sender.resolve_trainer_init).

The NCCL path itself needs a GPU (none here); what is checked is the choice between vLLM's
trainer-side entry points, against vLLM as installed and against stand-in namespaces shaped like
the versions that have one, the other, or neither.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vime.weight_sync.errors import WeightSyncError
from vime.weight_sync.sender import NCCL_VERSIONS, resolve_trainer_init


def factory_init(*a, **kw):
    return "factory"


def engine_init(*a, **kw):
    return "engine"


def test_the_factory_is_preferred_where_there_is_one():
    got = resolve_trainer_init(SimpleNamespace(trainer_init=factory_init), SimpleNamespace(trainer_init=engine_init), "x")
    assert got is factory_init


def test_the_engines_own_entry_point_without_a_factory():
    assert resolve_trainer_init(None, SimpleNamespace(trainer_init=engine_init), "x") is engine_init
    assert resolve_trainer_init(SimpleNamespace(), SimpleNamespace(trainer_init=engine_init), "x") is engine_init


def test_neither_says_which_versions_work():
    with pytest.raises(WeightSyncError) as exc:
        resolve_trainer_init(SimpleNamespace(), SimpleNamespace(), "0.99.0")
    msg = str(exc.value)
    assert "vLLM 0.99.0 has neither" in msg and NCCL_VERSIONS in msg
    assert exc.value.step == "init_weight_transfer_engine"


def test_the_installed_vllm_routes_through_its_factory():
    weight_transfer = pytest.importorskip("vllm.distributed.weight_transfer")
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    factory = weight_transfer.WeightTransferTrainerFactory
    got = resolve_trainer_init(factory, NCCLTrainerWeightTransferEngine, "installed")
    assert got == factory.trainer_init


# -- FleetSender(backend="nccl"): every path but the collective ------------------------------
# The NCCL collective needs GPUs (bench/check_nccl_fleet.py runs it on a multi-GPU host). Here
# the receivers are stand-in HTTP servers answering vLLM's weight routes as an NCCL engine does
# (recording what they get), and vLLM's trainer-side factory entry is replaced by a stand-in that
# does what vLLM's NCCLTrainerWeightTransferEngine.trainer_init and send_weights do apart from
# the communicator: the init_info through vLLM's own worker_init_payload, the tensors through
# the WeightSource our sender hands it.

import json  # noqa: E402
import threading  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

import torch  # noqa: E402


class NcclRoutes:
    """One stand-in receiver: vLLM's routes, answered as a one-worker NCCL engine would."""

    def __init__(self, fail_update: bool = False):
        self.calls: list[tuple[str, str, object]] = []
        self.version = "base"
        self.fail_update = fail_update
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.calls.append(("GET", self.path, None))
                if self.path == "/get_world_size":
                    return self._answer(200, {"world_size": 1})
                if self.path == "/weight_info":
                    return self._answer(200, {"weight_version": outer.version})
                self._answer(200, {})

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                path = self.path.split("?")[0]
                outer.calls.append(("POST", path, body))
                if path == "/update_weights" and outer.fail_update:
                    return self._answer(500, {"error": "Worker failed with error 'NCCL error'"})
                if path == "/finish_weight_update" and body:
                    outer.version = body["weight_version"]
                self._answer(200, {})

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def posted(self, path: str) -> list:
        return [b for m, p, b in self.calls if m == "POST" and p == path]

    def close(self) -> None:
        self.srv.shutdown()


class StandInTrainerEngine:
    """What vLLM's NCCLTrainerWeightTransferEngine does but the NCCL communicator: trainer_init
    sends the workers' init_info (rank_offset 1) through its client; send_weights drives its
    client and reads the source (where the broadcast would send it)."""

    made: list["StandInTrainerEngine"] = []

    def __init__(self, init_info, client, source):
        self.init_info, self.client, self.source = init_info, client, source
        self.sent: list[list[tuple[str, torch.Tensor]]] = []
        self.shut = False

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            worker_init_payload,
        )

        eng = cls(init_info, client, source)
        client.init_weight_transfer_engine(worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port,
            rank_offset=1, world_size=init_info.world_size, packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers)))
        cls.made.append(eng)
        return eng

    def send_weights(self):
        meta = self.source.metadata() if callable(self.source.metadata) else self.source.metadata
        self.client.start_weight_update()
        self.client.update_weights({"names": [m.name for m in meta]})
        self.sent.append([(n, t.clone()) for n, t in self.source])
        self.client.finish_weight_update()

    def shutdown(self):
        self.shut = True


@pytest.fixture
def nccl_stand_in(monkeypatch):
    weight_transfer = pytest.importorskip("vllm.distributed.weight_transfer")
    monkeypatch.setattr(weight_transfer.WeightTransferTrainerFactory, "trainer_init",
                        StandInTrainerEngine.trainer_init)
    StandInTrainerEngine.made = []
    routes = [NcclRoutes() for _ in range(3)]
    yield routes
    for r in routes:
        r.close()


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(32, 16, generator=g)), ("b.bias", torch.randn(5, generator=g).half())]


def test_the_nccl_fleet_push_runs_the_shared_path_with_one_group_over_every_receiver(nccl_stand_in):
    from vime.weight_sync.broadcast import FleetSender

    routes = nccl_stand_in
    urls = [r.url for r in routes]
    announced = []
    with FleetSender(backend="nccl", rendezvous_s=10, http_timeout=5,
                     announce=lambda rs, nb, bound: announced.append((rs, nb, bound))) as fs:
        for v in (1, 2):
            res = fs.push(urls, tensors(v), v)
            assert [r.status for r in res.values()] == ["ok"] * 3, res
        assert fs.group_inits == 1  # kept across versions
    (eng,) = StandInTrainerEngine.made
    # One group: the trainer rank 0, the three one-worker receivers at rank offsets 1, 2, 3.
    assert eng.init_info.world_size == 4 and eng.init_info.rank == 0 and eng.init_info.packed
    inits = [r.posted("/init_weight_transfer_engine")[0]["init_info"] for r in routes]
    assert [i["rank_offset"] for i in inits] == [1, 2, 3]
    assert all(i["world_size"] == 4 and i["master_port"] == eng.init_info.master_port and i["packed"]
               for i in inits)
    # vLLM's NCCL update_info (nothing of gloo's staging or chain), the version set at finish
    # and read back; the tensors handed to the collective, once per push.
    for r in routes:
        assert [set(b["update_info"]) for b in r.posted("/update_weights")] == [{"names", "dtype_names", "shapes"}] * 2
        assert r.posted("/finish_weight_update") == [{"weight_version": "1"}, {"weight_version": "2"}]
        assert [p for m, p, _ in r.calls if m == "POST"].count("/pause") == 2
    assert [[n for n, _ in sent] for sent in eng.sent] == [["a.weight", "b.bias"]] * 2
    assert all(torch.equal(t, w) for (_, t), (_, w) in zip(eng.sent[1], tensors(2)))
    assert announced[0][0] == urls and announced[0][2] > 0 and eng.shut


def test_an_nccl_receiver_failing_its_update_is_poisoned_and_the_others_verified(nccl_stand_in):
    """vLLM's NCCL engine loads as it receives (no staging): a receiver whose /update_weights
    fails is half-loaded, reported poisoned and not redone."""
    from vime.weight_sync.broadcast import FleetSender

    routes = nccl_stand_in
    routes[1].fail_update = True
    with FleetSender(backend="nccl", rendezvous_s=10, http_timeout=5) as fs:
        res = fs.push([r.url for r in routes], tensors(3), 3)
    bad = res[routes[1].url]
    assert bad.status == "poisoned" and bad.poisoned and not bad.redone, bad
    for r in (routes[0], routes[2]):
        assert res[r.url].ok and r.version == "3"
    assert routes[1].posted("/finish_weight_update") == []


def test_on_a_host_without_a_gpu_the_nccl_fleet_reports_why_and_calls_no_receiver(monkeypatch):
    """The installed vLLM's real trainer_init, here without a GPU: its rank 0 cannot open the
    communicator, so the group never forms (whether or not the receivers' init was sent first:
    vLLM sends it from a thread of its own); each receiver is reported intact with the cause and
    none is paused or sent an update."""
    pytest.importorskip("vllm.distributed.weight_transfer")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/check_nccl_fleet.py is the check")
    from vime.weight_sync.broadcast import FleetSender

    routes = [NcclRoutes() for _ in range(2)]
    try:
        res = FleetSender(backend="nccl", rendezvous_s=5, http_timeout=5).push([r.url for r in routes],
                                                                                 tensors(4), 4, redo=False)
    finally:
        for r in routes:
            r.close()
    for r in routes:
        assert res[r.url].status == "intact" and not res[r.url].ok, res[r.url]
        assert "rendezvous failed" in str(res[r.url].error)
        assert r.posted("/pause") == [] and r.posted("/update_weights") == []
