"""Wire layout shared by the sender (trainer) and the gloo engine (vLLM worker). Pure torch.

A push carries NCCL-style update_info: ``names``, ``dtype_names``, ``shapes`` (one entry per
tensor, in send order). Without ``buckets`` every tensor is one broadcast, exactly like vLLM's
unpacked NCCL path. With ``buckets`` (a list of tensor counts that sums to ``len(names)``) each
bucket is ONE broadcast of a flat uint8 buffer in which tensor i starts at an offset aligned to
``bucket_align`` bytes (so that ``view(dtype)`` is legal for every dtype); both sides compute the
offsets with `bucket_layout`, and ``bucket_nbytes`` lets the receiver check it agrees before
receiving anything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_BUCKET_ALIGN = 16
# The chain's pipelining unit: a hop delays the rest of the chain by one chunk's time, so a push
# into N receivers costs about (bytes + (N - 1) * chunk) / link rate.
DEFAULT_CHUNK_BYTES = 1 << 20
RELAY_WINDOW = 8  # sends in flight per relay (chunks are views: this bounds work, not memory)
RECV_AHEAD = 4  # receives posted ahead of the chunk awaited
TOPOLOGIES = ("chain", "tree")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def bucket_layout(sizes: Sequence[int], align: int = DEFAULT_BUCKET_ALIGN) -> tuple[list[int], int]:
    """Offsets of tensors of these byte sizes in one bucket, and the bucket's total size."""
    offsets, pos = [], 0
    for n in sizes:
        pos = align_up(pos, align)
        offsets.append(pos)
        pos += n
    return offsets, pos


@dataclass
class UpdatePlan:
    """What one push sends: the update_info JSON plus the tensors grouped by bucket."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    buckets: list[int] | None = None  # tensor counts per bucket; None: one broadcast per tensor
    bucket_nbytes: list[int] | None = None
    bucket_align: int = DEFAULT_BUCKET_ALIGN

    def update_info(self) -> dict:
        info: dict = {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}
        if self.buckets is not None:
            info.update(buckets=self.buckets, bucket_nbytes=self.bucket_nbytes,
                        bucket_align=self.bucket_align)
        return info

    @property
    def total_bytes(self) -> int:
        return sum(nbytes_of(s, dtype_from_name(d)) for s, d in zip(self.shapes, self.dtype_names))


DEFAULT_SOLO_BYTES = 1 << 20


def plan_update(meta: Sequence[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int,
                align: int = DEFAULT_BUCKET_ALIGN, solo_bytes: int | None = DEFAULT_SOLO_BYTES
                ) -> UpdatePlan:
    """Group (name, dtype, shape) entries, in order, into buckets of at most bucket_bytes.

    Only small tensors are worth packing: a tensor of solo_bytes or more (or larger than
    bucket_bytes) travels alone in its own bucket, which needs no copy (its bytes are broadcast
    in place). bucket_bytes <= 0 means no buckets at all (one broadcast per tensor, the NCCL
    engine's unpacked format); solo_bytes=None packs everything that fits.
    """
    plan = UpdatePlan(bucket_align=align)
    for name, dtype, shape in meta:
        plan.names.append(name)
        plan.dtype_names.append(dtype_name(dtype))
        plan.shapes.append([int(x) for x in shape])
    if bucket_bytes <= 0:
        return plan
    solo = bucket_bytes if solo_bytes is None else min(solo_bytes, bucket_bytes)
    plan.buckets, plan.bucket_nbytes = [], []
    count = 0
    sizes: list[int] = []

    def flush():
        nonlocal count, sizes
        if count:
            plan.buckets.append(count)
            plan.bucket_nbytes.append(bucket_layout(sizes, align)[1])
        count, sizes = 0, []

    for dtype, shape in zip(plan.dtype_names, plan.shapes):
        n = nbytes_of(shape, dtype_from_name(dtype))
        if n >= solo:
            flush()
            count, sizes = 1, [n]
            flush()
            continue
        if count and bucket_layout(sizes + [n], align)[1] > bucket_bytes:
            flush()
        count += 1
        sizes.append(n)
    flush()
    return plan


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU copy of t (no copy when t already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def pack_bucket(tensors: Sequence[torch.Tensor], align: int = DEFAULT_BUCKET_ALIGN) -> torch.Tensor:
    """One flat uint8 buffer holding these tensors at `bucket_layout` offsets."""
    flats = [as_bytes(t) for t in tensors]
    if len(flats) == 1:
        return flats[0]  # zero copy for a tensor that fills a bucket by itself
    offsets, total = bucket_layout([f.numel() for f in flats], align)
    buf = torch.empty(total, dtype=torch.uint8)
    for off, f in zip(offsets, flats):
        buf[off:off + f.numel()].copy_(f)
    return buf


def unpack_bucket(buf: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype],
                  shapes: Sequence[Sequence[int]], align: int = DEFAULT_BUCKET_ALIGN
                  ) -> list[tuple[str, torch.Tensor]]:
    """Views of buf as the named tensors (they keep buf alive; never reuse buf afterwards)."""
    sizes = [nbytes_of(s, d) for s, d in zip(shapes, dtypes)]
    offsets, _ = bucket_layout(sizes, align)
    return [(name, buf[off:off + n].view(dt).view(list(shape)))
            for name, dt, shape, off, n in zip(names, dtypes, shapes, offsets, sizes)]


def iter_buckets(plan: UpdatePlan, tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Sender side: the flat buffers to broadcast, in order (or the tensors themselves, unbucketed)."""
    it = iter(tensors)
    if plan.buckets is None:
        for _ in plan.names:
            yield as_bytes(next(it))
        return
    for count, expect in zip(plan.buckets, plan.bucket_nbytes or []):
        group = [next(it) for _ in range(count)]
        buf = pack_bucket(group, plan.bucket_align)
        if buf.numel() != expect:
            raise ValueError(f"packed bucket is {buf.numel()} bytes, planned {expect}")
        yield buf


def receive_update(broadcast, update_info: dict, load_weights) -> int:
    """Receiver side (the gloo engine, and the benchmark's model-less receiver).

    For each bucket (or tensor, unbucketed) allocate a fresh uint8 buffer and post
    ``broadcast(buf)`` (an asynchronous receive from rank 0 returning a Work); the next bucket's
    receive is posted before the current one is loaded, so receiving overlaps
    ``load_weights([(name, tensor), ...])`` (at most two buffers in flight).

    `broadcast` is a callable rather than the process group so that no frame of a failed receive
    keeps the group alive: gloo closes its connections only when the group object is destroyed
    (shutdown()/abort() do not), and the peer notices a failure only then.
    Fresh buffers: vLLM's layerwise reload keeps references to loaded tensors until a layer is
    complete, so a buffer is never reused. Returns the bytes received.
    """
    names = list(update_info["names"])
    dtypes = [dtype_from_name(d) for d in update_info["dtype_names"]]
    shapes = [list(s) for s in update_info["shapes"]]
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtype_names/shapes lengths differ: "
                         f"{len(names)}/{len(dtypes)}/{len(shapes)}")
    buckets = update_info.get("buckets")
    align = int(update_info.get("bucket_align") or DEFAULT_BUCKET_ALIGN)
    if buckets is None:
        buckets, align = [1] * len(names), 1
    if sum(buckets) != len(names):
        raise ValueError(f"buckets count {sum(buckets)} tensors, update_info names {len(names)}")
    expect = update_info.get("bucket_nbytes")
    totals, i = [], 0
    for b, count in enumerate(buckets):  # check the whole layout before receiving anything
        sizes = [nbytes_of(s, d) for s, d in zip(shapes[i:i + count], dtypes[i:i + count])]
        totals.append(bucket_layout(sizes, align)[1])
        i += count
        if expect is not None and expect[b] != totals[-1]:
            raise ValueError(f"bucket {b}: layout gives {totals[-1]} bytes, sender says {expect[b]}")
    starts = [0]
    for count in buckets:
        starts.append(starts[-1] + count)

    def post(b):
        buf = torch.empty(totals[b], dtype=torch.uint8)
        return buf, broadcast(buf)

    pending = post(0) if buckets else None
    for b in range(len(buckets)):
        assert pending is not None  # posted for every bucket there is
        buf, work = pending
        pending = post(b + 1) if b + 1 < len(buckets) else None
        work.wait()
        sl = slice(starts[b], starts[b + 1])
        load_weights(unpack_bucket(buf, names[sl], dtypes[sl], shapes[sl], align))
        del buf, work
    return sum(totals)


def chunk_bounds(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a buffer of nbytes (none for an empty buffer)."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, not {chunk}")
    return [(a, min(a + chunk, nbytes)) for a in range(0, nbytes, chunk)]


class ChainRelay:
    """The buffers of one push through one link of a chain broadcast, pipelined by chunks.

    The trainer (rank 0) sends each chunk to rank 1; rank r receives each chunk from r - 1 and,
    unless it is the last, forwards it to r + 1 as soon as it arrived, while the next ones arrive.
    Every link then carries the push once, so a push into N receivers costs about one transfer
    plus N - 1 chunks, where gloo's binomial-tree broadcast sends ceil(log2(N + 1)) copies down
    the trainer's link.

    `recv(view)` / `send(view)` post an asynchronous receive / send of a contiguous view and
    return its Work; `timeout` (a timedelta) bounds each wait: it is the stall window, the
    longest a hop may go without moving one chunk (a receive that gets nothing from the previous
    rank, a send the next rank does not take). A wait past it raises `ChainStalled`, which names
    the hop and the chunk, so a live rank next to a stopped one ends its receive within the
    window, not after the push's deadline (which side stopped, the trainer judges from each
    rank's progress reports: `counters`, vime.weight_sync.progress). The chunks of every buffer `add`ed
    form one sequence: receives are posted RECV_AHEAD chunks ahead in that order (gloo matches a
    peer's sends to our receives in posting order), across buffers, so the sender never waits on
    us to post one; at most RELAY_WINDOW sends are in flight. `add` returns a Work for the buffer
    (waited: every chunk of it arrived and was forwarded); `drain` waits out the last sends.
    """

    def __init__(self, chunk: int, recv=None, send=None, timeout=None) -> None:
        if chunk <= 0:
            raise ValueError(f"chunk must be positive, not {chunk}")
        self.chunk, self._recv, self._send, self._timeout = chunk, recv, send, timeout
        self._chunks: list = []  # views, in order; None once forwarded
        self._posted: list = []  # receive Works, for chunks [_done, _done + len)
        self._done = 0  # chunks arrived (and their forwards posted)
        self._sends: list = []
        self.longest_wait_s = 0.0  # the longest this hop waited for one chunk: its margin to the window
        self.forwarded = 0  # sends completed (the next rank took them); `received` is chunks arrived

    def _wait(self, work, what: str, index: int) -> None:
        t0 = time.monotonic()
        try:
            if self._timeout is None:
                work.wait()
            else:
                work.wait(self._timeout)
        except Exception as e:  # noqa: BLE001 - gloo's timeout or a closed peer: say which hop
            raise ChainStalled(what, index, self._timeout, e) from None
        finally:
            self.longest_wait_s = max(self.longest_wait_s, time.monotonic() - t0)
        if what == "send":
            self.forwarded += 1

    @property
    def received(self) -> int:
        return self._done

    def counters(self) -> tuple[int, int, float]:
        """What progress.Reporter reports: chunks received, chunks forwarded, longest wait."""
        return self._done, self.forwarded, self.longest_wait_s

    def add(self, buf: torch.Tensor) -> "_Through":
        flat = buf.reshape(-1)
        for a, b in chunk_bounds(flat.numel(), self.chunk):
            self._chunks.append(flat[a:b])
        self._post_ahead()
        if self._recv is None:  # the source: nothing to wait for before sending
            self._through(len(self._chunks))
        return _Through(self, len(self._chunks))

    def _post_ahead(self) -> None:
        if self._recv is None:
            return
        while (len(self._posted) < RECV_AHEAD
               and self._done + len(self._posted) < len(self._chunks)):
            self._posted.append(self._recv(self._chunks[self._done + len(self._posted)]))

    def _through(self, end: int) -> None:
        """Every chunk before `end` arrived and its forward posted."""
        while self._done < end:
            if self._recv is not None:
                self._wait(self._posted.pop(0), "recv", self._done)
            view, self._chunks[self._done] = self._chunks[self._done], None
            self._done += 1
            self._post_ahead()
            if self._send is not None:
                self._sends.append((self._done - 1, self._send(view)))
                if len(self._sends) > RELAY_WINDOW:
                    self._wait(*self._pop_send())

    def drain(self) -> None:
        """Every chunk added arrived and was forwarded, every send completed."""
        self._through(len(self._chunks))
        while self._sends:
            self._wait(*self._pop_send())

    def _pop_send(self) -> tuple:
        index, work = self._sends.pop(0)
        return work, "send", index


class ChainStalled(RuntimeError):
    """A chain hop moved nothing within the stall window, or its peer went away. `direction`:
    "recv" (nothing came from the previous rank) or "send" (the next rank took nothing)."""

    def __init__(self, direction: str, chunk: int, window, cause: BaseException):
        self.direction, self.chunk = direction, chunk
        hop = "receiving it from the previous rank" if direction == "recv" else "sending it to the next rank"
        window_s = f" (stall window {window.total_seconds():g}s)" if window is not None else ""
        super().__init__(f"chain hop failed at chunk {chunk}, {hop}{window_s}: {cause}")


class _Through:
    """The Work `ChainRelay.add` returns: waited, its buffer arrived and was forwarded."""

    def __init__(self, relay: ChainRelay, end: int) -> None:
        self._relay, self._end = relay, end

    def wait(self, timeout=None) -> bool:
        self._relay._through(self._end)
        return True

