"""Exceptions shared by the trainer-side sender and the disk path (no torch, no vLLM)."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync failed, but the engine's weights were not touched (or were fully loaded).

    The engine keeps serving its previous weights (or the new ones, when only a
    post-load step such as /resume failed; `step` says which). Retrying is safe.
    """

    def __init__(self, message: str, *, url: str | None = None, step: str | None = None):
        super().__init__(message)
        self.url = url
        self.step = step


class PoisonedEngine(WeightSyncError):
    """A failure between /start_weight_update and /finish_weight_update (or in reload_weights).

    vLLM's layerwise reload has moved the model's parameters to the meta device and never put
    them back: the engine may still answer /health with 200, but its next generation fails
    (measured: it kills the engine core). The engine is left paused by this package; the only
    remedy is to restart it.
    """

    def __init__(self, url: str, step: str, cause: BaseException | str):
        self.cause = cause
        super().__init__(
            f"engine {url} poisoned during {step}: {cause!s}; restart it", url=url, step=step)

    def __reduce__(self):  # picklable across processes (push_to_many results, subprocesses)
        return (PoisonedEngine, (self.url, self.step, str(self.cause)))


class CheckpointError(WeightSyncError, ValueError):
    """A checkpoint directory is missing, incomplete or does not match the served model."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path
