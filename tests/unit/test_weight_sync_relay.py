"""The chain broadcast's relay (weight_sync.packing.relay): each bucket passed rank to rank in
chunks, so every link carries it once.

The first test records the order of posts with a stand-in Work (no processes); the second runs
the relay over real ProcessGroupGloo groups in real processes, one per rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from vime.weight_sync.packing import RECV_AHEAD, RELAY_WINDOW, ChainRelay, chunk_bounds

ROOT = Path(__file__).resolve().parents[2]


def relay(buf: torch.Tensor, chunk: int, recv=None, send=None, timeout=None) -> None:
    """One buffer through a ChainRelay of its own, drained."""
    chain = ChainRelay(chunk, recv=recv, send=send, timeout=timeout)
    chain.add(buf)
    chain.drain()


def test_chunk_bounds_cover_the_buffer_once():
    assert chunk_bounds(0, 4) == []
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="positive"):
        chunk_bounds(8, 0)


class Recorder:
    """Works that complete when waited; `log` says what was posted and waited, in order."""

    def __init__(self, fill: torch.Tensor | None = None):
        self.log: list[tuple[str, int, int]] = []
        self.fill = fill

    def work(self, kind: str, view: torch.Tensor, start: int, fill: torch.Tensor | None = None):
        rec = self
        fill = self.fill if fill is None else fill

        class Work:
            def wait(self, timeout=None):
                rec.log.append(("wait-" + kind, start, view.numel()))
                if kind == "recv" and fill is not None:
                    view.copy_(fill[start:start + view.numel()])

        self.log.append((kind, start, view.numel()))
        return Work()


def test_a_middle_rank_forwards_each_chunk_once_it_arrived_with_receives_posted_ahead():
    src = torch.arange(10, dtype=torch.uint8)
    buf = torch.zeros(10, dtype=torch.uint8)
    rec = Recorder(fill=src)
    base = buf.data_ptr()
    relay(buf, 4, recv=lambda v: rec.work("recv", v, v.data_ptr() - base),
          send=lambda v: rec.work("send", v, v.data_ptr() - base), timeout=timedelta(seconds=1))
    assert torch.equal(buf, src)
    assert rec.log == [
        ("recv", 0, 4), ("recv", 4, 4), ("recv", 8, 2),
        ("wait-recv", 0, 4), ("send", 0, 4), ("wait-recv", 4, 4), ("send", 4, 4),
        ("wait-recv", 8, 2), ("send", 8, 2),
        ("wait-send", 0, 4), ("wait-send", 4, 4), ("wait-send", 8, 2)]


def test_buffers_form_one_sequence_receives_in_order_and_at_most_ahead():
    """Two buffers of one push: the second's receives are posted while the first arrives (the
    sender never waits on us), always in chunk order (gloo matches them in posting order)."""
    src = torch.arange(32, dtype=torch.uint8)
    a, b = torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    rec = Recorder()
    chunks = []  # (buffer, offset) in posting order

    def recv(v):
        which, off = (a, v.data_ptr() - a.data_ptr()) if a.data_ptr() <= v.data_ptr() < a.data_ptr() + 16 \
            else (b, v.data_ptr() - b.data_ptr())
        chunks.append((id(which), off))
        return rec.work("recv", v, off, fill=src[16:] if which is b else src[:16])

    chain = ChainRelay(2, recv=recv, send=lambda v: rec.work("send", v, 0))
    wa = chain.add(a)
    wb = chain.add(b)
    assert [k for k, _, _ in rec.log] == ["recv"] * RECV_AHEAD  # nothing waited yet
    wa.wait()
    assert torch.equal(a, src[:16])
    assert sum(1 for k, _, _ in rec.log if k == "recv") == 8 + RECV_AHEAD  # b's first, ahead
    wb.wait()
    chain.drain()
    assert torch.equal(b, src[16:])
    assert chunks == [(id(a), o) for o in range(0, 16, 2)] + [(id(b), o) for o in range(0, 16, 2)]
    outstanding = peak = 0
    for kind, _, _ in rec.log:
        outstanding += {"recv": 1, "wait-recv": -1}.get(kind, 0)
        peak = max(peak, outstanding)
    assert peak == RECV_AHEAD and outstanding == 0
    assert sum(1 for k, _, _ in rec.log if k == "wait-send") == 16


def test_the_senders_window_bounds_the_sends_in_flight():
    n = RELAY_WINDOW + 3
    rec = Recorder()
    buf = torch.zeros(n, dtype=torch.uint8)
    base = buf.data_ptr()
    relay(buf, 1, send=lambda v: rec.work("send", v, v.data_ptr() - base))
    in_flight = peak = 0
    for kind, _, _ in rec.log:
        in_flight += 1 if kind == "send" else -1
        peak = max(peak, in_flight)
    assert peak == RELAY_WINDOW + 1 and in_flight == 0
    assert [s for k, s, _ in rec.log if k == "send"] == list(range(n))


def test_an_empty_buffer_posts_nothing():
    rec = Recorder()
    relay(torch.empty(0, dtype=torch.uint8), 4, recv=lambda v: rec.work("recv", v, 0),
          send=lambda v: rec.work("send", v, 0))
    assert rec.log == []


CHILD = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from datetime import timedelta
    from vime.weight_sync.packing import ChainRelay
    rank, world, port = map(int, sys.argv[1:4])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
    g = torch.Generator().manual_seed(7)
    sizes = [1, 4096, 100_003, 0, 3 * 65536]
    for chunk in (65536, 1 << 20):
        for n in sizes:
            want = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
            buf = want.clone() if rank == 0 else torch.zeros(n, dtype=torch.uint8)
            chain = ChainRelay(chunk, recv=(lambda v: pg.recv([v], rank - 1, 0)) if rank else None,
                               send=(lambda v: pg.send([v], rank + 1, 0)) if rank + 1 < world else None,
                               timeout=timedelta(seconds=30))
            chain.add(buf)
            chain.drain()
            assert torch.equal(buf, want), (rank, chunk, n)
    print("ok", rank, flush=True)
""")


def test_a_chain_of_real_gloo_ranks_delivers_every_byte_to_every_rank():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 4
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(world), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {r}" in out, out[-2000:]
