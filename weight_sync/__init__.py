"""Move weights from a trainer into running vLLM engines.

* `vime.weight_sync.sender` (trainer side, pure torch): `WeightSender` (one engine),
  `push_deadline`.
* `vime.weight_sync.broadcast` (trainer side, pure torch): `FleetSender` (one group, one
  broadcast per version into every engine), `push_to_many`.
* `vime.weight_sync.gloo_engine` + `vime.weight_sync.vllm_plugin` (engine side): the "gloo" backend for
  vLLM's weight-transfer routes, registered by a ``vllm.general_plugins`` entry point.
* `vime.weight_sync.checkpoint` (disk path): `save_checkpoint`, `validate_checkpoint`,
  `reload_from_checkpoint`.

Importing this package is cheap (vLLM loads it in every process through the plugin entry
point): the names below are resolved lazily.
"""

from vime.weight_sync.errors import CheckpointError, PoisonedEngine, WeightSyncError

_LAZY = {
    "WeightSender": "vime.weight_sync.sender",
    "PushResult": "vime.weight_sync.push",
    "push_to_many": "vime.weight_sync.broadcast",
    "push_deadline": "vime.weight_sync.push",
    "FleetSender": "vime.weight_sync.broadcast",
    "save_checkpoint": "vime.weight_sync.checkpoint",
    "validate_checkpoint": "vime.weight_sync.checkpoint",
    "reload_from_checkpoint": "vime.weight_sync.checkpoint",
}

__all__ = ["CheckpointError", "PoisonedEngine", "WeightSyncError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")
