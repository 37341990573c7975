"""vLLM general plugin: registers the "gloo" weight-transfer backend (vime.weight_sync.gloo_engine),
and bounds how long vLLM's shared-memory queues spin when asked to (VIME_VLLM_IDLE_SPIN_S).

Entry point (pyproject.toml)::

    [project.entry-points."vllm.general_plugins"]
    vime_gloo_weight_transfer = "vime.weight_sync.vllm_plugin:register"

vLLM calls `register()` in the API server, the engine core and every worker process, possibly
more than once: it is idempotent, registers lazily by module path (nothing heavy is imported
until a server actually selects the backend with ``--weight-transfer-config
'{"backend":"gloo"}'``), and does nothing outside a vLLM install. The same engine is also
registered as "vime_gloo"; if some future vLLM ships its own "gloo" backend, that one keeps the
name "gloo" and ours stays reachable as "vime_gloo".

VIME_VLLM_IDLE_SPIN_S=SECONDS in an engine's environment: after each message, the readers of
vLLM's shared-memory queues (the Worker waiting for the EngineCore's next step, the EngineCore
waiting for the Worker's answer) spin on a core for this long before they sleep on a socket;
vLLM spins for 1 s. A heartbeat that generates once a second (the demo's, the tests') keeps an
idle engine's Worker at 100% of a core that way, starving whatever shares it (an engine booting
beside it took minutes on 2 cores). Unset (the default): vLLM's own 1 s, untouched.
"""

from __future__ import annotations

import functools
import os
import sys

from vime.weight_sync.idle_spin import MAX_SPIN_S, SPIN_ENV, spin_seconds  # noqa: F401 (MAX_SPIN_S: named here too)

ENGINE_MODULE = "vime.weight_sync.gloo_engine"
ENGINE_CLASS = "GlooWeightTransferEngine"
BACKEND_NAMES = ("gloo", "vime_gloo")



def register() -> None:
    if "vllm" not in sys.modules:  # only vLLM loads general plugins; never import it from here
        return
    try:
        bound_idle_spin()
    except ValueError as e:  # the daemon refuses it in its config; a hand-started engine says so here
        print(f"vime plugin: {e}; the queues' spin is left unchanged", file=sys.stderr)
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


def bound_idle_spin() -> float | None:
    """Apply VIME_VLLM_IDLE_SPIN_S to every SpinCondition this process creates after now (the
    plugin is loaded before the executor builds its queues). Returns the bound, or None when
    it is unset or vLLM has no SpinCondition. A value that is not seconds from 0 to 1 is an error.
    Nothing to bound where vLLM builds no shared-memory queue (the uniprocess executor), and
    VLLM_USE_SPINLOOP_EXT=1 spins in its own code whatever the bound."""
    seconds = spin_seconds(os.environ.get(SPIN_ENV, ""))
    if seconds is None:
        return None
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return None
    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is None:  # a vLLM whose queues do not spin this way: nothing to bound
        return None
    # Ours wrapped once, however often vLLM calls register(); another plugin's wrapper is kept.
    init = getattr(cls.__init__, "_vime_unbounded", cls.__init__)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if len(args) < 4:  # busy_loop_s not given positionally: ours instead of vLLM's default
            kwargs.setdefault("busy_loop_s", seconds)
        init(self, *args, **kwargs)

    __init__._vime_unbounded = init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return seconds
