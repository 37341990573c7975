"""vLLM general plugin: registers the "gloo" weight-transfer backend (vime.weight_sync.gloo_engine).

Entry point (pyproject.toml)::

    [project.entry-points."vllm.general_plugins"]
    vime_gloo_weight_transfer = "vime.weight_sync.vllm_plugin:register"

vLLM calls `register()` in the API server, the engine core and every worker process, possibly
more than once: it is idempotent, registers lazily by module path (nothing heavy is imported
until a server actually selects the backend with ``--weight-transfer-config
'{"backend":"gloo"}'``), and does nothing outside a vLLM install. The same engine is also
registered as "vime_gloo"; if some future vLLM ships its own "gloo" backend, that one keeps the
name "gloo" and ours stays reachable as "vime_gloo".
"""

from __future__ import annotations

import sys

ENGINE_MODULE = "vime.weight_sync.gloo_engine"
ENGINE_CLASS = "GlooWeightTransferEngine"
BACKEND_NAMES = ("gloo", "vime_gloo")


def register() -> None:
    if "vllm" not in sys.modules:  # only vLLM loads general plugins; never import it from here
        return
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API (< 0.32): nothing to register
        return
    for name in BACKEND_NAMES:
        if name in WeightTransferEngineFactory._registry:
            continue
        try:
            WeightTransferEngineFactory.register_engine(name, ENGINE_MODULE, ENGINE_CLASS)
        except ValueError:  # registered concurrently: fine
            pass
