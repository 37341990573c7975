"""Trainer side: push a model's weights into running vLLM engines over vLLM's weight-transfer API.

Pure torch + the standard library (http.client): a trainer needs no vLLM for the "gloo" backend.

One `WeightSender` drives ONE engine URL over its own small process group: the trainer is rank 0
and hosts the rendezvous (`TCPStore` master; keys go through ``PrefixStore("tcp://HOST:PORT")``
because that is what vLLM's ``stateless_init_torch_distributed_process_group`` on the engine
side uses), the engine's workers are ranks 1..N (``rank_offset`` 1, world size =
``GET /get_world_size`` + 1). A push is::

    /init_weight_transfer_engine   (first push only, in a thread beside the rendezvous)
    /pause?mode=abort              (in-flight requests come back with finish_reason "abort")
    /start_weight_update           (vLLM moves the parameters to meta: from here on, poison)
    /update_weights                (in a thread beside the broadcasts of the buckets)
    /finish_weight_update {"weight_version": "<version>"}
    /resume
    GET /weight_info               (must read back "<version>")

Tensors go in buckets (``bucket_bytes``, default 64 MiB): consecutive small tensors travel as
one broadcast of a flat uint8 buffer; a tensor of ``solo_bytes`` (1 MiB) or more goes alone,
broadcast in place without a copy (vime.weight_sync.packing). The next bucket is packed while the
previous one is on the wire, and the engine posts the next receive before loading the current
bucket. ``bucket_bytes=0`` sends one broadcast per tensor (the NCCL engine's unpacked format).

Group lifetime: the group is KEPT after a successful push and reused by the next push to the
same engine (``reuse_group=True``, the default), so a training loop pays the rendezvous once.
If the engine was restarted meanwhile, its gloo engine refuses /start_weight_update before
touching the model ("not initialized"); the sender then re-inits the group and retries once. Any
failure tears the group down; `close()` shuts it down on both sides
(/shutdown_weight_transfer_engine). ``reuse_group=False`` inits and shuts down per push.

Errors: a failure before /start_weight_update (or one the engine refused before touching the
model) raises `WeightSyncError`: the engine still serves its old weights and a retry is safe.
Any failure from /start_weight_update to /finish_weight_update raises
`PoisonedEngine(url, step, cause)`: vLLM has left meta tensors behind, the engine may still
answer /health but will fail its next generation; the sender leaves it PAUSED (so rollouts do not
crash it) and it must be restarted. A failure after a successful finish (/resume, the version
read-back) raises `WeightSyncError` with ``step`` set; the weights are loaded.

Timeouts: every HTTP call has one (``http_timeout``; ``transfer_timeout`` for /update_weights
and /pause?mode=wait), the process group has ``transfer_timeout`` per collective (also sent to
the engine as ``init_info.timeout_s`` and ``update_info.timeout_s`` so a dead trainer does not
leave a worker blocked for gloo's default 30 min), and the whole broadcast phase is bounded by
``transfer_timeout``. Left unset, ``transfer_timeout`` is `push_deadline` of the bytes pushed:
``rendezvous_s + bytes / floor rate`` (``$VIME_PUSH_FLOOR_MBPS``, default 50 MB/s;
``$VIME_PUSH_RENDEZVOUS_S``, default 30 s), so a push is bounded by what it moves.

Many engines: `vime.weight_sync.broadcast.FleetSender` pushes one version into all of them over
one group (one broadcast per bucket); `push_to_many` uses it unless ``broadcast=False``.

``backend="nccl"`` (GPU engines started with ``{"backend":"nccl"}``) delegates the transport to
vLLM's own ``NCCLTrainerWeightTransferEngine`` (so it imports vLLM) with this module's HTTP client
and the same error classification. UNTESTED here: these machines have no GPU.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import os
import time
import urllib.parse
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from vime.weight_sync.engine_http import HttpFailure, http_json, run_in_thread
from vime.weight_sync.errors import PoisonedEngine, WeightSyncError
from vime.weight_sync.packing import DEFAULT_SOLO_BYTES, iter_buckets, plan_update
from vime.weight_sync.push import (  # noqa: F401 - the names users import from here too
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FLOOR_MBPS,
    DEFAULT_RENDEZVOUS_S,
    ENV_FLOOR_MBPS,
    ENV_RENDEZVOUS,
    ENV_RENDEZVOUS_S,
    NOT_INITIALIZED,
    POISONED,
    NamedTensors,
    Progress,
    PushResult,
    detached,
    free_port,
    local_address_towards,
    named_tensor_list,
    push_deadline,
    tcp_uri,
)


def _wait_all(futures: list[cf.Future], timeout: float, what: str) -> None:
    """Wait for all; raise the first exception as soon as it happens, or TimeoutError."""
    done, pending = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
    for f in futures:  # the first failure in list order among those done
        if f in done and (err := f.exception()) is not None:
            raise err
    if pending:
        raise TimeoutError(f"{what} did not complete within {timeout:.0f}s")


class WeightSender:
    """Pushes named tensors into one vLLM engine (see the module docstring)."""

    def __init__(self, url: str, *, backend: str = "gloo", master_address: str | None = None,
                 master_port: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 solo_bytes: int | None = DEFAULT_SOLO_BYTES,
                 http_timeout: float = 30.0, transfer_timeout: float | None = None,
                 pause_mode: str | None = "abort", reuse_group: bool = True,
                 progress: Progress | None = None, floor_mbps: float | None = None,
                 rendezvous_s: float | None = None):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
        if pause_mode not in (None, "abort", "wait", "keep"):
            raise ValueError(f"pause_mode must be abort|wait|keep|None, not {pause_mode!r}")
        self.url = url.rstrip("/")
        self.backend = backend
        host = urllib.parse.urlsplit(self.url).hostname or "127.0.0.1"
        # Where the engine joins our rendezvous: given, else $VIME_RENDEZVOUS_ADDRESS (one
        # address of the trainer's node that every engine's node can reach), else the address
        # this machine routes towards the engine from.
        self.master_address = (master_address or os.environ.get(ENV_RENDEZVOUS, "").strip()
                               or local_address_towards(host))
        self.master_port = master_port
        self.bucket_bytes = bucket_bytes
        self.solo_bytes = solo_bytes
        self.http_timeout = http_timeout
        # None: each push's own push_deadline (set in push(), before anything uses it).
        self._derive_timeout = transfer_timeout is None
        self.floor_mbps, self.rendezvous_s = floor_mbps, rendezvous_s
        self.transfer_timeout = (transfer_timeout if transfer_timeout is not None
                                 else push_deadline(0, floor_mbps, rendezvous_s))
        self.pause_mode = pause_mode
        self.reuse_group = reuse_group
        self.progress = progress
        self.group_inits = 0  # rendezvous done over this sender's life
        self._store = None
        self._pg = None
        self._world_size: int | None = None
        self._nccl: Any = None  # vLLM NCCLTrainerWeightTransferEngine (backend="nccl")

    # -- plumbing ---------------------------------------------------------------------------
    def _call(self, method: str, path: str, *, timeout: float | None = None, **kw) -> Any:
        return http_json(self.url, method, path, timeout=timeout or self.http_timeout, **kw)

    def _note(self, step: str, **info) -> None:
        if self.progress is not None:
            self.progress(step, {"url": self.url, **info})

    @property
    def has_group(self) -> bool:
        return self._pg is not None or self._nccl is not None

    # -- group ------------------------------------------------------------------------------
    def _init_group(self) -> None:
        self._drop_group()
        try:
            ws = int(self._call("GET", "/get_world_size")["world_size"]) + 1
        except HttpFailure as e:
            raise WeightSyncError(f"{self.url}: GET /get_world_size failed: {e}", url=self.url,
                                  step="get_world_size") from e
        if self.backend == "nccl":
            return self._init_nccl(ws)
        import torch.distributed as dist

        port = self.master_port or free_port(self.master_address if self.master_address != "0.0.0.0" else "")
        timeout = timedelta(seconds=self.transfer_timeout)
        init_info = {"master_address": self.master_address, "master_port": port,
                     "rank_offset": 1, "world_size": ws, "timeout_s": self.transfer_timeout}
        try:
            store = dist.TCPStore(self.master_address, port, ws, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"cannot host the rendezvous on {self.master_address}:{port}: {e}",
                                  url=self.url, step="init_weight_transfer_engine") from e
        prefix = dist.PrefixStore(tcp_uri(self.master_address, port), store)
        init_http = run_in_thread(self._call, "POST", "/init_weight_transfer_engine",
                                   body={"init_info": init_info}, name="wsync-init-http")
        make_pg = run_in_thread(dist.ProcessGroupGloo, prefix, 0, ws, timeout, name="wsync-init-pg")
        try:
            _wait_all([init_http, make_pg], self.http_timeout + 30, "the group rendezvous")
        except BaseException as e:
            if isinstance(e, HttpFailure) and POISONED in e.body:
                raise PoisonedEngine(self.url, "init_weight_transfer_engine", e) from e
            # The engine never loaded anything: its weights are intact.
            raise WeightSyncError(f"{self.url}: /init_weight_transfer_engine failed: {e}",
                                  url=self.url, step="init_weight_transfer_engine") from e
        self._store, self._pg, self._world_size = store, make_pg.result(), ws
        self.group_inits += 1

    def _init_nccl(self, ws: int) -> None:  # UNTESTED (no GPU here)
        try:
            import vllm
            from vllm.distributed import weight_transfer
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )
        except ImportError as e:
            raise WeightSyncError(f"backend='nccl' needs vLLM ({NCCL_VERSIONS}) on the trainer: {e}",
                                  url=self.url, step="init_weight_transfer_engine") from e
        trainer_init = resolve_trainer_init(getattr(weight_transfer, "WeightTransferTrainerFactory", None),
                                            NCCLTrainerWeightTransferEngine,
                                            getattr(vllm, "__version__", "?"))
        port = self.master_port or free_port("")
        self._nccl_client = _NcclClient(self)
        self._nccl_source = DeferredSource()
        try:
            self._nccl = trainer_init(
                NCCLTrainerInitInfo(master_address=self.master_address, master_port=port,
                                    world_size=ws, rank=0, packed=True,
                                    packed_buffer_size_bytes=max(self.bucket_bytes, 1 << 20)),
                client=self._nccl_client, source=self._nccl_source.as_weight_source())
        except BaseException as e:
            raise WeightSyncError(f"{self.url}: NCCL init failed: {e}", url=self.url,
                                  step="init_weight_transfer_engine") from e
        self._world_size = ws
        self.group_inits += 1

    def drop_group(self) -> None:
        """Forget the group without telling the engine (it joined another group)."""
        self._drop_group()

    def _drop_group(self) -> None:
        """Tear down the local end (no HTTP): after a failure, or before a re-init."""
        pg, store, nccl = self._pg, self._store, self._nccl
        self._pg = self._store = self._nccl = None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                pass
        if nccl is not None:
            try:
                nccl.shutdown()
            except Exception:  # noqa: BLE001
                pass
        if pg is not None:
            del pg, store  # the last references: destroying the group closes its connections
            gc.collect()  # in case a cycle (an exception's traceback) still holds it

    def close(self) -> None:
        """Shut the group down on the engine (best effort) and locally."""
        if self.has_group:
            try:
                self._call("POST", "/shutdown_weight_transfer_engine")
            except HttpFailure:
                pass
        self._drop_group()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- push -------------------------------------------------------------------------------
    def push(self, named_tensors: NamedTensors, version: int | str) -> PushResult:
        """Push one version; returns a PushResult (ok=True) or raises (see module docstring)."""
        version = str(version)
        res = PushResult(url=self.url, version=version)
        t_all = time.monotonic()
        inits_before = self.group_inits

        def step(name: str, fn: Callable[[], Any]) -> Any:
            t0 = time.monotonic()
            self._note(name)
            try:
                return fn()
            finally:
                res.steps[name] = res.steps.get(name, 0.0) + time.monotonic() - t0

        pairs = named_tensor_list(named_tensors)
        plan = plan_update([(n, t.dtype, t.shape) for n, t in pairs], self.bucket_bytes,
                           solo_bytes=self.solo_bytes)
        res.tensors, res.bytes = len(pairs), plan.total_bytes
        res.buckets = len(plan.buckets) if plan.buckets is not None else len(pairs)
        if self._derive_timeout:
            self.transfer_timeout = push_deadline(res.bytes, self.floor_mbps, self.rendezvous_s)
        res.deadline_s = self.transfer_timeout

        if not self.has_group:
            step("init_weight_transfer_engine", self._init_group)

        if self.pause_mode is not None:
            pause_timeout = self.transfer_timeout if self.pause_mode == "wait" else self.http_timeout
            try:
                step("pause", lambda: self._call("POST", "/pause", params={"mode": self.pause_mode},
                                                 timeout=pause_timeout))
            except HttpFailure as e:
                raise WeightSyncError(f"{self.url}: /pause failed: {e}", url=self.url, step="pause") from e

        if self.backend == "nccl":
            step("transfer", lambda: self._push_nccl(pairs, version))
        else:
            self._start(step)
            step("update_weights", lambda: self._transfer(plan, pairs))
            try:
                step("finish_weight_update", lambda: self._call(
                    "POST", "/finish_weight_update", body={"weight_version": version},
                    timeout=self.transfer_timeout))
            except HttpFailure as e:
                self._drop_group()
                raise PoisonedEngine(self.url, "finish_weight_update", e) from e

        if self.pause_mode is not None:
            try:
                step("resume", lambda: self._call("POST", "/resume"))
            except HttpFailure as e:
                raise WeightSyncError(f"{self.url}: weights {version} loaded but /resume failed: {e}",
                                      url=self.url, step="resume") from e
        try:
            got = step("weight_info", lambda: self._call("GET", "/weight_info"))
        except HttpFailure as e:
            raise WeightSyncError(f"{self.url}: GET /weight_info failed: {e}", url=self.url,
                                  step="weight_info") from e
        if not isinstance(got, dict) or got.get("weight_version") != version:
            raise WeightSyncError(f"{self.url}: /weight_info reads {got!r} after pushing version "
                                  f"{version!r}", url=self.url, step="weight_info")
        if not self.reuse_group:
            self.close()
        res.ok = True
        res.group_inits = self.group_inits - inits_before
        res.seconds = time.monotonic() - t_all
        return res

    def _start(self, step) -> None:
        """POST /start_weight_update; re-init once if the engine lost (or never had) our group."""
        for attempt in (1, 2):
            try:
                step("start_weight_update", lambda: self._call("POST", "/start_weight_update"))
                return
            except HttpFailure as e:
                if not e.delivered:
                    raise WeightSyncError(f"{self.url}: engine unreachable: {e}", url=self.url,
                                          step="start_weight_update") from e
                if e.status is not None and POISONED in e.body:
                    self._drop_group()
                    raise PoisonedEngine(self.url, "start_weight_update", e) from e
                if e.status is not None and NOT_INITIALIZED in e.body:
                    # Refused before the model was touched (e.g. the engine was restarted).
                    if attempt == 2:
                        raise WeightSyncError(f"{self.url}: {e}", url=self.url,
                                              step="start_weight_update") from e
                    step("init_weight_transfer_engine", self._init_group)
                    continue
                # Anything else (timeout, "already active", ...): the model may be on meta.
                self._drop_group()
                raise PoisonedEngine(self.url, "start_weight_update", e) from e

    def _post_send(self, buf: torch.Tensor):
        # Reads self._pg each time: no frame of a failed transfer may keep the group alive, since
        # gloo closes the connections (and so fails the engine's pending receive at once instead
        # of after its timeout) only when the group object is destroyed; abort()/shutdown() do not.
        if self._pg is None:
            raise WeightSyncError("process group dropped during the transfer", url=self.url)
        return self._pg.broadcast(buf, 0, timedelta(seconds=self.transfer_timeout))

    def _transfer(self, plan, pairs) -> None:
        """/update_weights in one thread, the broadcasts in another; first failure wins."""
        n_buckets = len(plan.buckets) if plan.buckets is not None else len(pairs)

        def broadcasts():
            # Bucket i+1 is packed while bucket i is on the wire (at most two in flight).
            pending = None
            for i, buf in enumerate(iter_buckets(plan, (t for _, t in pairs))):
                work = self._post_send(buf)
                if pending is not None:
                    self._finish_send(*pending, n_buckets)
                pending = (i, buf, work)
            if pending is not None:
                self._finish_send(*pending, n_buckets)

        update = run_in_thread(self._call, "POST", "/update_weights",
                                body={"update_info": {**plan.update_info(),
                                                      "timeout_s": self.transfer_timeout}},
                                timeout=self.transfer_timeout, name="wsync-update-http")
        send = run_in_thread(broadcasts, name="wsync-broadcast")
        try:
            _wait_all([update, send], self.transfer_timeout + 5, "the transfer")
        except BaseException as e:
            # Drop (destroy) our end so the engine's pending receive fails now; never reuse it.
            self._drop_group()
            raise PoisonedEngine(self.url, "update_weights", detached(e)) from None

    def _finish_send(self, i: int, buf: torch.Tensor, work, n_buckets: int) -> None:
        work.wait()
        self._note("bucket_sent", index=i, of=n_buckets, nbytes=buf.numel())

    def _push_nccl(self, pairs, version: str) -> None:  # UNTESTED (no GPU here)
        client = self._nccl_client
        client.started = False
        self._nccl_source.pairs = pairs
        try:
            self._nccl.send_weights()  # start, update || packed NCCL broadcast, finish (no version)
        except BaseException as e:
            self._drop_group()
            if client.started:
                raise PoisonedEngine(self.url, client.step, e) from e
            raise WeightSyncError(f"{self.url}: NCCL push failed before start: {e}", url=self.url,
                                  step=client.step) from e
        try:
            self._call("POST", "/update_weight_version", body={"new_version": version})
        except HttpFailure as e:
            raise WeightSyncError(f"{self.url}: weights loaded but /update_weight_version failed: {e}",
                                  url=self.url, step="update_weight_version") from e


NCCL_VERSIONS = "vLLM 0.32 or 0.33: their trainer API was read there; never run here, no GPU"


def resolve_trainer_init(factory: Any, engine_cls: Any, vllm_version: str) -> Callable[..., Any]:
    """vLLM's trainer-side NCCL entry point: `WeightTransferTrainerFactory.trainer_init` (0.32+,
    the only one left on vLLM's main, which removes the engines' static names, #50902), else the
    engine class's own `trainer_init` (0.32/0.33); neither: a WeightSyncError naming what works."""
    if factory is not None and callable(getattr(factory, "trainer_init", None)):
        return factory.trainer_init
    if callable(getattr(engine_cls, "trainer_init", None)):
        return engine_cls.trainer_init
    raise WeightSyncError(f"vLLM {vllm_version} has neither WeightTransferTrainerFactory.trainer_init nor "
                          f"NCCLTrainerWeightTransferEngine.trainer_init: backend='nccl' needs "
                          f"{NCCL_VERSIONS}", step="init_weight_transfer_engine")


class _NcclClient:
    """vLLM's VLLMWeightSyncClient protocol over this module's HTTP helper, tracking the step."""

    def __init__(self, sender: WeightSender):
        self.sender, self.started, self.step = sender, False, "init_weight_transfer_engine"

    def _post(self, step: str, body=None, timeout=None):
        self.step = step
        if step == "start_weight_update":
            self.started = True
        self.sender._call("POST", "/" + step, body=body, timeout=timeout)

    def init_weight_transfer_engine(self, init_info):
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self._post("start_weight_update")

    def update_weights(self, update_info):
        self._post("update_weights", {"update_info": update_info}, self.sender.transfer_timeout)

    def finish_weight_update(self, weight_version=None):
        self._post("finish_weight_update", {"weight_version": weight_version}
                   if weight_version is not None else None, self.sender.transfer_timeout)

    def shutdown_weight_transfer_engine(self):
        self._post("shutdown_weight_transfer_engine")


class DeferredSource:
    """A vLLM WeightSource over the pairs of the current push (0.32: metadata() is a method;
    0.33: a property)."""

    def __init__(self):
        self.pairs: list = []

    def as_weight_source(self):
        import inspect

        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        outer = self

        def meta(_self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in outer.pairs]

        is_prop = isinstance(inspect.getattr_static(WeightSource, "metadata"), property)
        cls = type("VimeNamedTensorSource", (WeightSource,), {
            "metadata": property(meta) if is_prop else meta,
            "__iter__": lambda _self: iter(list(outer.pairs)),
        })
        return cls()
