"""Trainer side: push one version into a fleet of engines over ONE group (a chain through every engine).

`FleetSender` is `WeightSender`'s fleet path. The trainer is rank 0 and hosts the TCPStore;
engine k joins with ``rank_offset = 1 + sum of the earlier engines' world sizes`` and
``world_size = 1 + sum of all``. Each bucket goes down a chain (``topology="chain"``, the
default): the trainer sends it to rank 1 in ``chunk_bytes`` pieces and every rank forwards each
piece to the next as it arrives (packing.ChainRelay), so every link carries it once and a push into N
engines costs about one transfer plus N - 1 chunks (into one receiving rank: a plain
broadcast, one op per bucket rather than per chunk). gloo's own broadcast (``topology="tree"``) is
a binomial tree whose every rank sends to all its children at once: the trainer's link carries
ceil(log2(N+1)) copies (docs/benchmarks.md has both, measured). The group is built once and
reused; it is rebuilt only when the set of receiver URLs changes (or after a failure, which
always drops it: a stale group must never block a push). WeightSender's per-engine group stays
the path for the resync of one restarted engine.

A push (every HTTP call to the N engines in parallel threads, never one after the other)::

    GET /get_world_size, /init_weight_transfer_engine   (only when the group is (re)built)
    /pause?mode=abort, /start_weight_update             (start only marks the session)
    /update_weights {"staged": true, ...}               (beside the trainer's broadcasts)
    /finish_weight_update {"weight_version"}, /resume, GET /weight_info

Staged: an engine receives every bucket into host memory before touching its model, so a fault
anywhere in the collective (an engine killed, stopped, or the deadline passed) leaves every
other engine's weights intact (its 500 carries gloo_engine.NOT_LOADED).

One bound per push, announced and enforced: ``deadline_s = rendezvous_s + bytes / floor rate``
(push.push_deadline; $VIME_PUSH_FLOOR_MBPS, default 50 MB/s; $VIME_PUSH_RENDEZVOUS_S, default
30 s) is one attempt's, and ``push_bound(deadline_s, redo)`` (two deadlines with the redo, one
without, plus GRACE_S) the whole push's, what ``announce`` tells the daemon. Every wait of an
attempt ends by its deadline (the first attempt's) or by the bound less TEARDOWN_S (the redo's,
which so always fits inside the bound, and the finish's after a collective that succeeded);
whatever is still open then is cut and reported.

A stalled receiver is found by progress: every receiving rank of a chain reports its relay's
progress to the group's store (progress.Reporter, under ``update_info.progress_key``) and the
trainer reads the reports as the transfer runs (progress.ProgressWatch). A receiver whose
reports do not move for ``stall_s`` (the stall window, default DEFAULT_STALL_S) is stopped: only
it is condemned ("unreachable", its call cut), whenever that is seen, in the transfer or while
the others' answers are awaited. One that keeps reporting is alive, however slow, starved by a
stopped upstream or backed up behind a stopped downstream: never condemned, its answer awaited
up to the attempt's end. Every hop also waits at most the window for its next chunk
(packing.ChainStalled), which only ends that live receiver's receive (intact, redone). On a
failure the trainer destroys its end of the group (closing its sockets fails its direct peers'
receives at once), cuts the stopped ones (and one that sent no report in a window and does not
answer GET /health), and redoes the survivors over a new group. Every thread is
joined or ends with its call; none outlives a push by more than its socket timeout.

Failure semantics: `push` never raises for an engine's fault. It returns one `PushResult` per
URL with ``status``: "ok", "intact" (nothing loaded, resumed on its old weights: safe to push
again), "poisoned" (half-loaded: restart it; left paused) or "unreachable" (refused, reset, timed
out). After a failed collective the push is redone ONCE over the intact survivors (a new group),
unless ``redo=False``; their results say ``redone``.

``announce(receivers, nbytes, deadline_s)`` is called before a push (so the daemon can excuse
the paused engines for exactly that long) and ``on_done(results)`` after it.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import os
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

from vime.weight_sync.engine_http import Call, HttpFailure, run_in_thread
from vime.weight_sync.errors import PoisonedEngine, WeightSyncError
from vime.weight_sync.packing import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_SOLO_BYTES,
    TOPOLOGIES,
    UpdatePlan,
    ChainRelay,
    iter_buckets,
    plan_update,
)
from vime.weight_sync.progress import ProgressWatch, read_reports, report_period
from vime.weight_sync.push import (
    DEFAULT_BUCKET_BYTES,
    ENV_RENDEZVOUS,
    NOT_INITIALIZED,
    NOT_LOADED,
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
from vime.weight_sync.sender import NCCL_VERSIONS, WeightSender, DeferredSource, resolve_trainer_init

BACKENDS = ("gloo", "nccl")
NCCL_UPDATE_KEYS = ("names", "dtype_names", "shapes")  # vLLM's NCCLWeightTransferUpdateInfo

Announce = Callable[[list[str], int, float], None]
OnDone = Callable[[dict[str, PushResult]], None]

GRACE_S = 5.0  # on top of a deadline, for the HTTP answer that follows the last byte
PROBE_S = 2.0  # after a failed collective: an engine silent on /health this long is cut
TEARDOWN_S = 2.0  # kept at the end of a push's bound to cut what is still open and join it
# The chain's stall window: a receiver whose progress reports do not move for this long is judged
# stopped and cut (progress.ProgressWatch); a hop that moves no chunk for this long fails
# (packing.ChainStalled: intact, redone). Healthy chain pushes into 8 receivers on the loaded
# 2-core host paused a live rank's reports 1.09 s (one due a second) and a hop's chunk 0.09 s
# at most, 1.15 s beside a receiver stopped 0.3 s in 0.5 (docs/weights.md): 7 s is the margin
# for real engines, whose calls start apart, and busier hosts.
DEFAULT_STALL_S = 7.0


def push_bound(deadline: float, redo: bool) -> float:
    """The longest a whole `FleetSender.push` takes, what it announces: one deadline for the
    attempt, one more for the redo over the survivors, and GRACE_S. Enforced: whatever is still
    open when it is TEARDOWN_S away is cut and reported."""
    return deadline * (2 if redo else 1) + GRACE_S


def _joined_ranks(prefix: Any, world: int) -> set[int] | None:
    """The ranks that reached the group's rendezvous: gloo's full-mesh connect writes each
    rank's address under "0/<rank>" in the (prefixed) store, before it waits for the others
    (torch 2.x). None when even our own rank 0's key is missing: a layout this does not know."""
    try:
        joined = {r for r in range(world) if prefix.check([f"0/{r}"])}
    except Exception:  # noqa: BLE001 - a store gone or a layout unknown: say so, never guess
        return None
    return joined if 0 in joined else None


class FleetSender:
    """Pushes named tensors into many engines over one gloo group (see the module docstring)."""

    def __init__(self, *, backend: str = "gloo", master_address: str | None = None,
                 master_port: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 solo_bytes: int | None = DEFAULT_SOLO_BYTES, http_timeout: float = 30.0,
                 transfer_timeout: float | None = None, floor_mbps: float | None = None,
                 rendezvous_s: float | None = None, pause_mode: str | None = "abort",
                 progress: Progress | None = None, announce: Announce | None = None,
                 on_done: OnDone | None = None, reuse_group: bool = True,
                 topology: str = "chain", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 stall_s: float = DEFAULT_STALL_S):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, not {topology!r}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        if not stall_s > 0:
            raise ValueError(f"stall_s must be positive, not {stall_s}")
        if pause_mode not in (None, "abort", "keep"):
            raise ValueError(f"pause_mode must be abort|keep|None, not {pause_mode!r}")
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.bucket_bytes, self.solo_bytes = bucket_bytes, solo_bytes
        self.http_timeout = http_timeout
        self.transfer_timeout = transfer_timeout  # None: push_deadline(bytes) per push
        self.floor_mbps, self.rendezvous_s = floor_mbps, rendezvous_s
        self.pause_mode = pause_mode
        self.progress, self.announce, self.on_done = progress, announce, on_done
        self.reuse_group = reuse_group
        self.topology, self.chunk_bytes = topology, chunk_bytes
        self.stall_s = stall_s
        self._until: float | None = None  # during a push: when its current attempt must be over
        self._end: float | None = None  # and when the whole push must be (its bound, less TEARDOWN_S)
        self.group_inits = 0  # group rendezvous over this sender's life
        self._pg: Any = None  # gloo: the ProcessGroupGloo; nccl: vLLM's trainer engine
        self._store: Any = None
        self._members: tuple[str, ...] = ()  # the URLs the live group was built for, in rank order
        self._rank_of: dict[int, str] = {}  # the live group's receiving ranks -> their URL
        self._pushes = 0  # transfers so far: each chain transfer's progress reports have their own key
        self.last_watch: ProgressWatch | None = None  # the last chain transfer's progress reports
        # After a failed rendezvous the engines that joined keep waiting in theirs (their /init
        # timeout_s, the rendezvous bound) and answer nothing else meanwhile: the next build waits that out.
        self._joining_until = 0.0

    # -- plumbing ---------------------------------------------------------------------------
    def deadline_for(self, nbytes: int) -> float:
        if self.transfer_timeout is not None:
            return float(self.transfer_timeout)
        return push_deadline(nbytes, self.floor_mbps, self.rendezvous_s)

    @property
    def members(self) -> tuple[str, ...]:
        return self._members if self._pg is not None else ()

    def _note(self, step: str, **info) -> None:
        if self.progress is not None:
            self.progress(step, info)

    def _left(self, want: float) -> float:
        """`want` seconds, or what is left of the current attempt if less (never 0: a socket
        timeout of 0 would mean non-blocking)."""
        if self._until is None:
            return want
        return max(0.05, min(want, self._until - time.monotonic()))

    def _each(self, urls: Sequence[str], method: str, path: str, *, timeout: float,
              body: Any = None, params: dict | None = None, wait: float | None = None
              ) -> dict[str, Any]:
        """The same call to every URL at once (a thread each); url -> answer or HttpFailure.
        Waits `wait` (default timeout + GRACE_S) at most, then cuts the calls still open."""
        calls = {u: Call(u, method, path, body=body, params=params, timeout=self._left(timeout))
                 for u in urls}
        futs = {u: run_in_thread(c.run, name=f"fleet-{path.strip('/')}") for u, c in calls.items()}
        cf.wait(list(futs.values()), timeout=self._left(timeout + GRACE_S if wait is None else wait))
        return self._settle_all(calls, futs)

    @staticmethod
    def _settle_all(calls: dict[str, Call], futs: dict[str, cf.Future], join: float = 1.0) -> dict[str, Any]:
        """Each call's answer or HttpFailure; the calls still open are cut (all at once) first."""
        open_ = [u for u, f in futs.items() if not f.done()]
        for u in open_:
            calls[u].cancel()
        if open_:  # their sockets are shut: the threads end now
            cf.wait([futs[u] for u in open_], timeout=join)
        return {u: FleetSender._settle(calls[u], f) for u, f in futs.items()}

    @staticmethod
    def _settle(call: Call, fut: cf.Future) -> Any:
        if not fut.done():
            return HttpFailure(call.method, call.path, cause=TimeoutError("no answer"))
        err = fut.exception()
        if err is None:
            return fut.result()
        return err if isinstance(err, HttpFailure) else HttpFailure(call.method, call.path, cause=err)

    # -- group ------------------------------------------------------------------------------
    def drop_group(self) -> None:
        """Forget the group without telling the engines (one of them joined another group):
        the next push builds a new one."""
        self._drop_group()

    def _drop_group(self) -> None:
        """Destroy the local end: gloo closes its connections only when the group object dies,
        which fails the receivers' pending receives at once (shutdown()/abort() do not)."""
        pg, store = self._pg, self._store
        self._pg = self._store = None
        self._members = ()
        if pg is not None:
            try:
                pg.shutdown()  # ProcessGroupGloo's, or vLLM's trainer engine's (destroys its communicator)
            except Exception:  # noqa: BLE001
                pass
            del pg, store
            gc.collect()  # in case a cycle (an exception's traceback) still holds it

    def _build_group(self, urls: list[str], results: dict[str, PushResult], deadline: float
                     ) -> list[str]:
        """Rendezvous with every URL that answers; returns the members (in rank order)."""
        import torch.distributed as dist

        self._drop_group()
        busy = max(0.0, self._joining_until - time.monotonic())
        sizes = self._each(urls, "GET", "/get_world_size", timeout=self.http_timeout + busy)
        members, world = [], 1
        offsets: dict[str, int] = {}
        ranks: dict[str, range] = {}
        for u in urls:
            got = sizes[u]
            if isinstance(got, HttpFailure) or not isinstance(got, dict):
                results[u].status = "unreachable"
                results[u].error = WeightSyncError(f"{u}: GET /get_world_size failed: {got}", url=u,
                                                   step="get_world_size")
                continue
            offsets[u] = world
            ranks[u] = range(world, world + int(got["world_size"]))
            world += int(got["world_size"])
            members.append(u)
        if not members:
            return []
        host = urllib.parse.urlsplit(members[0]).hostname or "127.0.0.1"
        addr = (self.master_address or os.environ.get(ENV_RENDEZVOUS, "").strip()
                or local_address_towards(host))
        port = self.master_port or free_port(addr if addr != "0.0.0.0" else "")
        rdv = timedelta(seconds=self._left(push_deadline(0, self.floor_mbps, self.rendezvous_s)))
        # Our rank 0 (beside the calls, in a thread of its own: both sides rendezvous together),
        # and each member's init_info: only the collective differs between the backends.
        if self.backend == "nccl":
            store = prefix = None
            make_pg, init_info = self._nccl_rank0(addr, port, world, rdv)
        else:
            store = dist.TCPStore(addr, port, world, is_master=True, timeout=rdv, wait_for_workers=False)
            prefix = dist.PrefixStore(tcp_uri(addr, port), store)
            make_pg = run_in_thread(dist.ProcessGroupGloo, prefix, 0, world, rdv, name="fleet-init-pg")
            init_info = {"master_address": addr, "master_port": port, "world_size": world,
                         "timeout_s": rdv.total_seconds()}
        calls = {u: Call(u, "POST", "/init_weight_transfer_engine",
                         timeout=self._left(self.http_timeout + rdv.total_seconds()),
                         body={"init_info": {**(init_info or {}), "rank_offset": offsets[u]}})
                 for u in (members if init_info is not None else [])}
        futs = {u: run_in_thread(c.run, name="fleet-init-http") for u, c in calls.items()}
        cf.wait([make_pg, *futs.values()], timeout=self._left(rdv.total_seconds() + GRACE_S))
        answers = self._settle_all(calls, futs)
        if init_info is None:  # vLLM's trainer_init failed before its init call: none was made
            answers = {u: HttpFailure("POST", "/init_weight_transfer_engine", delivered=False,
                                      cause=make_pg.exception() or TimeoutError("trainer_init"))
                       for u in members}
        failed = [u for u in members if isinstance(answers[u], HttpFailure)]
        if failed and (not make_pg.done() or make_pg.exception() is not None):
            # The rendezvous never completed: one receiver that never joined holds every
            # other's /init in the collective, so all were cut alike. Nothing was paused or
            # touched yet, so the ones that did join are intact (the redo's group), whether
            # their call was cut or they gave up on the rendezvous themselves (a 500).
            cut = [u for u in failed if POISONED not in answers[u].body]
            joined = _joined_ranks(prefix, world) if prefix is not None else None
            if joined is not None:
                absent = {u for u in cut if not set(ranks[u]) <= joined}
            else:  # the store's layout is not the one known: those silent on /health
                alive = self._each(cut, "GET", "/health", timeout=min(self.http_timeout, PROBE_S))
                absent = {u for u in cut if isinstance(alive[u], HttpFailure)}
            failed = [u for u in failed if u not in cut or u in absent]
        for u in failed:
            e = answers[u]
            results[u].status = "poisoned" if POISONED in e.body else "unreachable"
            results[u].error = (PoisonedEngine(u, "init_weight_transfer_engine", e)
                                if results[u].status == "poisoned" else
                                WeightSyncError(f"{u}: /init_weight_transfer_engine failed: {e}",
                                                url=u, step="init_weight_transfer_engine"))
        if failed or not make_pg.done() or make_pg.exception() is not None:
            # The group cannot form without them (its constructor gives up after rdv); the
            # others loaded nothing: intact, and in the redo's group if there is one.
            why = make_pg.exception() if make_pg.done() else TimeoutError("rendezvous timed out")
            self._joining_until = time.monotonic() + rdv.total_seconds() + GRACE_S
            for u in members:
                if u not in failed:
                    results[u].status = "intact"
                    results[u].error = WeightSyncError(f"{u}: group rendezvous failed: {why}",
                                                       url=u, step="init_weight_transfer_engine")
            del store, prefix
            return []
        self._pg, self._store, self._members = make_pg.result(), store, tuple(members)
        self._rank_of = {r: u for u in members for r in ranks[u]}
        self.group_inits += 1
        for u in members:
            results[u].group_inits += 1
        return members

    # -- push -------------------------------------------------------------------------------
    def push(self, urls: Iterable[str], named_tensors: NamedTensors, version: int | str, *,
             redo: bool = True) -> dict[str, PushResult]:
        """Push one version into every URL; never raises for an engine's fault (see the module
        docstring). Results are in the order of `urls`, keyed by each URL without a trailing
        "/" (the same engine twice in `urls` is pushed once)."""
        version = str(version)
        urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
        pairs = named_tensor_list(named_tensors)
        plan = plan_update([(n, t.dtype, t.shape) for n, t in pairs], self.bucket_bytes,
                           solo_bytes=self.solo_bytes)
        nbytes = plan.total_bytes
        deadline = self.deadline_for(nbytes)
        if not urls:
            return {}
        bound = push_bound(deadline, redo)
        if self.announce is not None:  # an exception here aborts the push before any call
            self.announce(list(urls), nbytes, bound)
        t0 = time.monotonic()
        end = t0 + bound - TEARDOWN_S  # every wait below ends by then; what is open is cut
        self._end = end
        results = {u: PushResult(url=u, version=version, bytes=nbytes, tensors=len(pairs),
                                 buckets=len(plan.buckets) if plan.buckets is not None else len(pairs),
                                 deadline_s=deadline, bound_s=bound) for u in urls}
        try:
            self._until = min(t0 + deadline, end) if redo else end
            failed_collective = self._attempt(urls, pairs, plan, version, deadline, results)
            again = [u for u in urls if results[u].status == "intact"]
            if redo and failed_collective and again:
                # The redo has the rest of the bound: at least one deadline, as announced.
                self._until = end
                self._note("redo", receivers=again)
                for u in again:
                    results[u] = PushResult(url=u, version=version, bytes=nbytes, tensors=len(pairs),
                                            buckets=results[u].buckets, deadline_s=deadline,
                                            bound_s=bound, redone=True)
                self._attempt(again, pairs, plan, version, self._left(deadline), results)
            self._until = t0 + bound - TEARDOWN_S / 2
            if not self.reuse_group:
                self.close()
        finally:
            self._until = self._end = None
        for r in results.values():
            r.seconds = time.monotonic() - t0
            r.ok = r.status == "ok"
            if not r.status:  # the bound passed before its answer: cut, reported
                r.status = "unreachable"
                r.error = r.error or WeightSyncError(f"{r.url}: cut at the push's bound {bound:.1f}s",
                                                     url=r.url)
            if r.status == "intact" and r.error is None:
                r.error = WeightSyncError(f"{r.url}: not loaded (weights intact): the push failed "
                                          f"in another receiver", url=r.url, step="update_weights")
        if self.on_done is not None:
            self.on_done(results)
        return results

    def _attempt(self, urls: list[str], pairs, plan: UpdatePlan, version: str, deadline: float,
                 results: dict[str, PushResult]) -> bool:
        """One broadcast into `urls`; fills their results. True when the collective failed."""
        t0 = time.monotonic()
        members = list(self._members) if self._pg is not None and list(self._members) == urls else []
        if not members:
            self._note("init_weight_transfer_engine", receivers=urls)
            members = self._build_group(urls, results, deadline)
            if self._pg is None:  # some failed to join: the rest are intact; the caller redoes
                return True
        for u in members:
            results[u].steps["init"] = time.monotonic() - t0

        def fail(u: str, status: str, step: str, e: BaseException) -> None:
            results[u].status = status
            results[u].error = (PoisonedEngine(u, step, e) if status == "poisoned" else
                                WeightSyncError(f"{u}: {step} failed: {e}", url=u, step=step))

        # pause + start: nothing touched yet. A fault here costs a new group for the rest.
        live = list(members)
        if self.pause_mode is not None:
            self._note("pause", receivers=live)
            for u, got in self._each(live, "POST", "/pause", timeout=self.http_timeout,
                                     params={"mode": self.pause_mode}).items():
                if isinstance(got, HttpFailure):
                    fail(u, "unreachable", "pause", got)
        live = [u for u in live if not results[u].status]
        self._note("start_weight_update", receivers=live)
        started = []
        for u, got in self._each(live, "POST", "/start_weight_update", timeout=self.http_timeout).items():
            if not isinstance(got, HttpFailure):
                started.append(u)
            elif got.status is None:
                fail(u, "unreachable", "start_weight_update", got)
            elif NOT_INITIALIZED in got.body:  # restarted: lost the group, model untouched
                fail(u, "intact", "start_weight_update", got)
            else:
                fail(u, "poisoned", "start_weight_update", got)
        if len(started) != len(members):
            self._drop_group()
            if self.backend == "nccl":
                # vLLM's NCCL engine moves the model to meta at start: a session without its
                # update cannot be cancelled intact. Left paused, to be restarted.
                for u in started:
                    fail(u, "poisoned", "start_weight_update",
                         RuntimeError("started, but the push failed in another receiver"))
                return True
            self._cancel_sessions(started, results)
            for u in started:
                results[u].status = "intact"
            return True
        t1 = time.monotonic()
        ok_transfer = self._transfer(members, pairs, plan, deadline, results)
        for u in members:
            results[u].steps["update_weights"] = time.monotonic() - t1
        if not ok_transfer:
            self._drop_group()
            return True
        if self._end is not None:  # the collective succeeded: no redo follows, the rest of the bound is the finish's
            self._until = self._end
        self._finish(members, version, deadline, results)
        return False

    def _cancel_sessions(self, started: list[str], results: dict[str, PushResult]) -> None:
        """Engines that started a session but got no update: finish it empty (nothing was
        loaded, no version given) and resume them on their old weights."""
        for u, got in self._each(started, "POST", "/finish_weight_update", timeout=self.http_timeout).items():
            if isinstance(got, HttpFailure):
                results[u].error = WeightSyncError(f"{u}: cancelling the session failed: {got}", url=u)
        self._resume(started, results)

    def _resume(self, urls: list[str], results: dict[str, PushResult]) -> None:
        if self.pause_mode is None or not urls:
            return
        for u, got in self._each(urls, "POST", "/resume", timeout=self.http_timeout).items():
            if isinstance(got, HttpFailure):
                results[u].status = "unreachable"
                results[u].error = WeightSyncError(f"{u}: /resume failed: {got}", url=u, step="resume")

    def _transfer(self, members: list[str], pairs, plan: UpdatePlan, deadline: float,
                  results: dict[str, PushResult]) -> bool:
        """/update_weights into every member (a thread each) beside the broadcasts of the
        buckets (one more thread). True when every member loaded every byte."""
        # One receiving rank: a chain of one is a plain send, which gloo's broadcast makes in one
        # op per bucket instead of one per chunk (measured: 0.13 s against 0.42 s for 63 MB).
        deadline = self._left(deadline)  # what is left of the attempt
        info: dict[str, Any]
        watch: ProgressWatch | None = None
        self.last_watch = None
        started = time.monotonic()
        store = self._store  # kept to read the reports after the group is torn down
        if self.backend == "nccl":  # vLLM's update_info; one NCCL broadcast, no stall window
            stall = deadline
            info = {k: v for k, v in plan.update_info().items() if k in NCCL_UPDATE_KEYS}
            send = run_in_thread(self._send_nccl, pairs, name="fleet-broadcast")
        else:
            topology = self.topology if self._pg is not None and self._pg.size() > 2 else "tree"
            stall = min(self.stall_s, deadline) if topology == "chain" else deadline
            info = {**plan.update_info(), "staged": True, "timeout_s": deadline, "stall_s": stall,
                    "topology": topology, "chunk_bytes": self.chunk_bytes}
            if topology == "chain" and self._store is not None:
                self._pushes += 1
                info["progress_key"] = f"vime/chain/{os.getpid()}/{self._pushes}"
                watch = self.last_watch = ProgressWatch(dict(self._rank_of), stall)
            send = run_in_thread(self._send_buckets, plan, pairs, topology,
                                 timedelta(seconds=stall), name="fleet-broadcast")
        calls = {u: Call(u, "POST", "/update_weights", body={"update_info": info},
                         timeout=deadline + GRACE_S) for u in members}
        futs = {u: run_in_thread(c.run, name="fleet-update-http") for u, c in calls.items()}
        all_futs = [send, *futs.values()]
        stopped = self._await_transfer(all_futs, deadline, store, info.get("progress_key"), watch)
        failed = stopped or any(f.done() and f.exception() is not None for f in all_futs) \
            or not all(f.done() for f in all_futs)
        if watch is not None and not failed:
            read_reports(store, str(info["progress_key"]), watch)  # the last ones: longest waits
        if failed:
            self._cut_the_transfer(send, calls, futs, deadline, stall, store,
                                   info.get("progress_key"), watch, started)
        del store
        answers = self._settle_all(calls, futs)
        try:
            send.exception(timeout=self._left(GRACE_S))  # a destroyed group fails its pending send
        except cf.TimeoutError:
            pass
        if not failed:
            return True
        self._after_a_failed_transfer(members, answers, deadline, results)
        return False

    def _await_transfer(self, futs: list[cf.Future], deadline: float, store: Any, key: str | None,
                        watch: ProgressWatch | None) -> bool:
        """Until every future is done, one fails, the attempt's deadline passes, or (a chain with
        progress reports) a receiver stops reporting for a stall window: True for the last."""
        end = time.monotonic() + deadline
        period = report_period(watch.window_s) if watch is not None else deadline
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            done, pending = cf.wait(futs, timeout=min(period, left), return_when=cf.FIRST_EXCEPTION)
            if not pending or any(f.exception() is not None for f in done):
                return False
            if watch is not None and key is not None:
                read_reports(store, key, watch)
                if watch.stopped(time.monotonic()):
                    return True

    def _send_buckets(self, plan: UpdatePlan, pairs, topology: str, op_timeout: timedelta) -> None:
        """The trainer's side of the transfer (its own thread): every bucket down the chain to
        rank 1, or broadcast to the group (gloo's tree)."""
        n_buckets = len(plan.buckets) if plan.buckets is not None else len(pairs)
        pending: Any = None  # bucket i+1 is packed while bucket i is on the wire
        work: Any = None
        chain = (ChainRelay(self.chunk_bytes, send=self._send_first, timeout=op_timeout)
                 if topology == "chain" else None)
        try:
            for i, buf in enumerate(iter_buckets(plan, (t for _, t in pairs))):
                if self._pg is None:
                    raise WeightSyncError("fleet group dropped during the transfer")
                if chain is not None:  # every chunk to rank 1, which relays it
                    chain.add(buf)
                    self._note("bucket_sent", index=i, of=n_buckets)
                    continue
                work = self._pg.broadcast(buf, 0, op_timeout)  # no local ref to the group
                if pending is not None:
                    pending[1].wait()
                    self._note("bucket_sent", index=pending[0], of=n_buckets)
                pending = (i, work)
                del work
            if pending is not None:
                pending[1].wait()
                self._note("bucket_sent", index=pending[0], of=n_buckets)
            if chain is not None:
                chain.drain()
        except BaseException as e:
            # The future keeps the exception: no frame of it may keep a Work (and through
            # it the group) alive, or destroying the group would not close its sockets.
            pending = work = chain = None
            raise detached(e) from None

    def _cut_the_transfer(self, send: cf.Future, calls: dict[str, Call], futs: dict[str, cf.Future],
                          deadline: float, stall: float, store: Any = None, key: str | None = None,
                          watch: ProgressWatch | None = None, started: float = 0.0) -> None:
        """The transfer failed (or ran out of time): destroy our end of the group, cut the call of
        each receiver that stopped, and await every other one's answer (a live one's hop fails
        within a stall window: packing.ChainStalled), never past the attempt's end.

        Stopped is judged by progress reports (progress.ProgressWatch): a receiver whose reports
        did not move for a stall window; one that keeps reporting, however slow, or starved by
        a stopped neighbour, is never cut. A receiver that sent no report (the tree, an engine
        without reports, one stopped before its receive began) is judged by GET /health."""
        now = time.monotonic()
        stopped = watch.stopped_urls(now) if watch is not None else set()
        cause = next((f.exception() for f in (send, *futs.values()) if f.done() and f.exception()),
                     None)
        if stopped and watch is not None:
            cause = cause or TimeoutError(f"no progress for the stall window {stall:g}s: "
                                          f"{watch.describe(watch.stopped(now))}")
        cause = cause or TimeoutError(f"the broadcast did not complete within its deadline {deadline:.1f}s")
        self._note("transfer_failed", cause=repr(cause), stopped=sorted(stopped))
        # Destroy our end now: our direct peers' receives fail at once; one stalled behind a
        # stopped peer fails on its hop's stall window.
        self._drop_group()
        for u in stopped:
            calls[u].cancel()
        # An engine that sent no report and does not answer /health (vLLM serves it beside a
        # transfer) is stopped or gone: cut its call now rather than wait out the deadline. With
        # reports, one that sent none is probed PROBE_S only once it had a window to send one
        # (a live receiver reports within a period of its receive's start).
        silent = [u for u, f in futs.items()
                  if not f.done() and u not in stopped and (watch is None or not watch.reporting(u))]
        if silent:
            probe = PROBE_S if watch is None else max(PROBE_S, stall - (time.monotonic() - started))
            probes = self._each(silent, "GET", "/health", timeout=min(self.http_timeout, probe))
            for u in silent:
                if isinstance(probes[u], HttpFailure):
                    calls[u].cancel()
        if watch is None or key is None:
            cf.wait([send, *futs.values()], timeout=self._left(stall + GRACE_S))
            return
        # The rest report (or answered): await each, cutting any that stops reporting meanwhile.
        period = report_period(watch.window_s)
        end = self._until if self._until is not None else time.monotonic() + deadline
        while True:
            pending = [u for u, f in futs.items() if not f.done()]
            if not pending or time.monotonic() >= end:
                break
            cf.wait([futs[u] for u in pending], timeout=self._left(period), return_when=cf.FIRST_COMPLETED)
            read_reports(store, key, watch)
            for u in watch.stopped_urls(time.monotonic()) - stopped:
                if not futs[u].done():
                    stopped.add(u)
                    self._note("stopped", receiver=u)
                    calls[u].cancel()
        cf.wait([send], timeout=self._left(GRACE_S))

    def _after_a_failed_transfer(self, members: list[str], answers: dict[str, Any], deadline: float,
                                 results: dict[str, PushResult]) -> None:
        """Each member's status from its /update_weights answer: loaded (finished and kept),
        intact (resumed on its old weights), poisoned or unreachable."""
        loaded, intact = [], []
        for u in members:
            got = answers[u]
            if not isinstance(got, HttpFailure):
                loaded.append(u)  # every byte landed and loaded before the fault: keep it
            elif got.status is None:
                results[u].status = "unreachable"
                results[u].error = WeightSyncError(f"{u}: /update_weights: {got}", url=u,
                                                   step="update_weights")
            elif NOT_LOADED in got.body:
                intact.append(u)
                results[u].status = "intact"
                results[u].error = WeightSyncError(f"{u}: not loaded (weights intact): {got}",
                                                   url=u, step="update_weights")
            else:
                results[u].status = "poisoned"
                results[u].error = PoisonedEngine(u, "update_weights", detached(got))
        self._resume(intact, results)
        if loaded:
            self._finish(loaded, results[loaded[0]].version, deadline, results)

    # -- nccl: vLLM's trainer engine for the collective only (UNTESTED here: no GPU) ----------
    def _nccl_rank0(self, addr: str, port: int, world: int, rdv: timedelta) -> tuple[cf.Future, dict | None]:
        """Rank 0 of an NCCL group over every member, by vLLM's trainer-side API (the factory
        route WeightSender's NCCL path takes): its trainer_init opens the communicator and asks
        its client to init the workers (rank_offset 1, one engine's); our client only records
        that init_info, which the shared code posts to each member with its own rank_offset.
        Returns the trainer_init future and the recorded init_info (None: it failed first)."""
        client = _FleetClient()
        self._nccl_source = DeferredSource()
        fut = run_in_thread(self._nccl_trainer_init, addr, port, world, client, name="fleet-init-pg")
        end = time.monotonic() + self._left(rdv.total_seconds())
        while not client.called.wait(0.05):
            if fut.done() or time.monotonic() > end:
                return fut, None
        return fut, client.init_info

    def _nccl_trainer_init(self, addr: str, port: int, world: int, client: "_FleetClient") -> Any:
        try:
            import vllm
            from vllm.distributed import weight_transfer
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )
        except ImportError as e:
            raise WeightSyncError(f"backend='nccl' needs vLLM ({NCCL_VERSIONS}) on the trainer: {e}",
                                  step="init_weight_transfer_engine") from e
        trainer_init = resolve_trainer_init(getattr(weight_transfer, "WeightTransferTrainerFactory", None),
                                            NCCLTrainerWeightTransferEngine, getattr(vllm, "__version__", "?"))
        return trainer_init(
            NCCLTrainerInitInfo(master_address=addr, master_port=port, world_size=world, rank=0,
                                packed=True, packed_buffer_size_bytes=max(self.bucket_bytes, 1 << 20)),
            client=client, source=self._nccl_source.as_weight_source())

    def _send_nccl(self, pairs) -> None:
        """The trainer's side of the NCCL transfer: vLLM's send_weights, whose client calls are
        no-ops (this sender makes them, to every member, as for gloo), so only its packed
        broadcast runs here."""
        engine = self._pg
        if engine is None:
            raise WeightSyncError("fleet group dropped during the transfer")
        self._nccl_source.pairs = pairs
        try:
            engine.send_weights()
        except BaseException as e:
            engine = None
            raise detached(e) from None

    def _send_first(self, view):
        if self._pg is None:
            raise WeightSyncError("fleet group dropped during the transfer")
        return self._pg.send([view], 1, 0)

    def _finish(self, urls: list[str], version: str, deadline: float,
                results: dict[str, PushResult]) -> None:
        self._note("finish_weight_update", receivers=urls)
        resume = []
        # One receiver that never finishes must not leave the others no time to be resumed and
        # verified: a third of what is left (an HTTP timeout at most) is kept for that.
        timeout = max(deadline, self.http_timeout)
        left = self._left(timeout + GRACE_S)
        wait = max(0.05, left - min(self.http_timeout, left / 3))
        for u, got in self._each(urls, "POST", "/finish_weight_update", timeout=timeout, wait=wait,
                                 body={"weight_version": version}).items():
            if isinstance(got, HttpFailure):
                results[u].status = "poisoned"
                results[u].error = PoisonedEngine(u, "finish_weight_update", got)
            else:
                resume.append(u)
        self._resume(resume, results)
        for u, got in self._each([u for u in resume if not results[u].status], "GET", "/weight_info",
                                 timeout=self.http_timeout).items():
            if isinstance(got, HttpFailure) or not isinstance(got, dict):
                results[u].status = "unreachable"
                results[u].error = WeightSyncError(f"{u}: GET /weight_info: {got}", url=u,
                                                   step="weight_info")
            elif got.get("weight_version") != version:
                results[u].status = "unreachable"
                results[u].error = WeightSyncError(f"{u}: /weight_info reads {got!r} after pushing "
                                                   f"{version!r}", url=u, step="weight_info")
            else:
                results[u].status = "ok"

    def close(self) -> None:
        """Shut the group down on its members (best effort, in parallel) and locally."""
        members = list(self.members)
        if members:
            self._each(members, "POST", "/shutdown_weight_transfer_engine", timeout=self.http_timeout)
        self._drop_group()

    def __enter__(self) -> "FleetSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _FleetClient:
    """vLLM's VLLMWeightSyncClient for the NCCL fleet path: records the workers' init_info that
    trainer_init builds; every other call is made by FleetSender itself, to every member."""

    def __init__(self) -> None:
        import threading

        self.called = threading.Event()
        self.init_info: dict | None = None

    def init_weight_transfer_engine(self, init_info) -> None:
        self.init_info = dict(init_info)
        self.init_info.pop("rank_offset", None)  # each member's own, from the shared code
        self.called.set()

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        pass

    def finish_weight_update(self, weight_version=None) -> None:
        pass

    def shutdown_weight_transfer_engine(self) -> None:
        pass


def push_to_many(urls: Iterable[str], named_tensors: NamedTensors, version: int | str, *,
                 senders: dict[str, WeightSender] | None = None, broadcast: bool = True,
                 fleet: Any = None, **sender_kwargs) -> dict[str, PushResult]:
    """Push one version into several engines. Never raises for an engine's failure: each result
    has ok/error (error.poisoned says the engine must be restarted).

    broadcast=True (the default, gloo): one FleetSender broadcast into all of them; pass
    `fleet` (a FleetSender) to keep its group across versions, else it is closed after the push.
    broadcast=False, and backend="nccl" without a `fleet`: one after the other, each over its own
    group; pass a `senders` dict (url -> WeightSender, filled in as needed) to keep those groups.
    (FleetSender(backend="nccl") is the GPU fleet path, never run here: pass it as `fleet`.)
    """
    if broadcast and (fleet is not None or sender_kwargs.get("backend", "gloo") == "gloo"):
        kw = {k: v for k, v in sender_kwargs.items() if k != "reuse_group"}
        own_fleet = fleet is None
        fs = FleetSender(**kw) if fleet is None else fleet
        try:
            return fs.push(urls, named_tensors, version)
        finally:
            if own_fleet:
                fs.close()
    pairs = named_tensor_list(named_tensors)
    results: dict[str, PushResult] = {}
    own = senders is None
    senders = {} if senders is None else senders
    for url in urls:
        sender = senders.get(url)
        if sender is None:
            sender = senders[url] = WeightSender(url, **sender_kwargs)
        t0 = time.monotonic()
        try:
            results[url] = sender.push(pairs, version)
        except WeightSyncError as e:
            results[url] = PushResult(url=url, version=str(version), ok=False,
                                      seconds=time.monotonic() - t0, error=e)
        except Exception as e:  # noqa: BLE001 - e.g. a bad tensor: report it per engine
            results[url] = PushResult(url=url, version=str(version), ok=False,
                                      seconds=time.monotonic() - t0,
                                      error=WeightSyncError(f"{url}: {e!r}", url=url))
        finally:
            if own:
                sender.close()
    return results


__all__ = ["FleetSender", "push_to_many", "push_bound", "push_deadline"]
