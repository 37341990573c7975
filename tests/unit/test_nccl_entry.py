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
