"""Move weights from a trainer into running vLLM engines.

* `weight_sync.sender` (trainer side, pure torch): `WeightSender`, `push_to_many`.
* `weight_sync.gloo_engine` + `weight_sync.vllm_plugin` (engine side): the "gloo" backend for
  vLLM's weight-transfer routes, registered by a ``vllm.general_plugins`` entry point.
* `weight_sync.checkpoint` (disk path): `save_checkpoint`, `validate_checkpoint`,
  `reload_from_checkpoint`.

Importing this package is cheap (vLLM loads it in every process through the plugin entry
point): the names below are resolved lazily.
"""

from weight_sync.errors import CheckpointError, PoisonedEngine, WeightSyncError

_LAZY = {
    "WeightSender": "weight_sync.sender",
    "PushResult": "weight_sync.sender",
    "push_to_many": "weight_sync.sender",
    "save_checkpoint": "weight_sync.checkpoint",
    "validate_checkpoint": "weight_sync.checkpoint",
    "reload_from_checkpoint": "weight_sync.checkpoint",
}

__all__ = ["CheckpointError", "PoisonedEngine", "WeightSyncError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")
