"""The daemon's journal: what a restarted daemon needs so that nothing is lost (the round, the
weight version, its checkpoint and fingerprint, the membership epoch, each engine's process and
verified version, the spawned router), written atomically whenever it changes (docs/operations.md).

A journal is untrusted input: `load` checks it against the schema below, and one that does
not fit is moved aside by the daemon, never half-used; only a bad weight_fingerprint (checked
again once the trainer publishes the version with one) or a bad epoch (the wall-clock floor,
policy.starting_epoch, keeps the next one ahead) is dropped alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from .engine.fingerprint import Fingerprint, FingerprintError
from .engine.fingerprint import parse as parse_fingerprint
from .fleet import Fleet
from .policy import EPOCH_MAX
from .engine.process import boot_id, engine_fingerprint
from .router.link import RouterLink
from .events import Listener
from .states import State
from .tasks import TaskSet, cancel_and_wait

log = structlog.get_logger("vime.journal")
FORMAT = 1


class JournalError(Exception):
    pass


def snapshot(fleet: Fleet, router: RouterLink | None = None, *, path: Path | None = None) -> dict[str, Any]:
    """The journal to write (`path`: where, recorded so that a copy is known as one)."""
    engines = {}
    for r in fleet.runners.values():
        proc = r.proc
        entry: dict[str, Any] = {
            "state": r.journal_state.value,
            "incarnation": r.fsm.incarnation,
            "restarts": r.fsm.restarts,
            # Only a version the daemon verified counts: RUNNING/SUSPECT engines' versions.
            "verified_version": r.fsm.weight_version if r.fsm.state in (State.RUNNING, State.SUSPECT) else None,
            "retired": r.retired,
            # STOPPED by an operator, not by the daemon's own shutdown: only that survives a
            # restart (EngineRunner.shutdown sets stopped_by_shutdown).
            "operator_stopped": r.fsm.state is State.STOPPED and not r.stopped_by_shutdown,
        }
        if r.spec.spawned:  # the config that starts it: a reload keeps a FATAL engine FATAL only under it
            entry.update(fingerprint=engine_fingerprint(r.spec, r.cfg), reason=r.fsm.reason)
        if proc is not None and proc.returncode is None and proc.start_time is not None:
            entry.update(pid=proc.pid, start_time=proc.start_time, port=r.spec.port, log_path=str(proc.log_path))
            if r.fsm.spawned_at is not None:  # wall clock: a reload goes on counting first_wait from it
                entry["spawned_at"] = round(time.time() - (r.clock() - r.fsm.spawned_at), 3)
        engines[r.name] = entry
    out: dict[str, Any] = {
        "format": FORMAT,
        "boot_id": _BOOT_ID,
        "daemon_pid": os.getpid(),
        "round": fleet.round,
        "round_open": fleet.round_open,
        "weight_version": fleet.current_version,
        "checkpoint": fleet.checkpoint,
        # Consumers keep the highest epoch they saw: the next daemon goes on past it.
        "epoch": fleet.epoch,
        "engines": engines,
    }
    if path is not None:  # pids name processes of the daemon that wrote here, not of one reading a copy
        out["journal_path"] = str(path.absolute())
    if fleet.fingerprint is not None:  # a restarted daemon still checks engines by what they compute
        version, fp = fleet.fingerprint
        out["weight_fingerprint"] = {"version": version, **fp.to_json()}
    spawned = router.journal_entry() if router is not None else None
    if spawned is not None:  # the spawned router ([router] spawn): adopted as an engine is
        out["router"] = spawned
    return out


_BOOT_ID = boot_id()


# Every number is kept as int64 by some consumer (metrics, the socket's clients): a journal
# with a 400-digit round made /v1/metrics answer 500 and every round call 409.
_MAX = 2**63 - 1
PID_MAX = 1 << 22  # the kernel's ceiling for pid_max


def _int(v: Any, lo: int = 0, hi: int = _MAX) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check(ok: bool, where: str, what: str, value: Any, problems: list[str]) -> None:
    if not ok:
        problems.append(f"{where}: {what}, got {value!r:.80}")


_STATES = {s.value for s in State}


def validate(data: Any) -> list[str]:
    """What is wrong with a parsed journal (empty: nothing). Every field the daemon reads is
    checked here, so restoring one cannot raise or leave the fleet in a state no request can
    get out of (a string round, an open round with no number)."""
    if not isinstance(data, dict):
        return [f"not a JSON object but {type(data).__name__}"]
    p: list[str] = []
    _check(data.get("format") == FORMAT, "format", f"must be {FORMAT}", data.get("format"), p)
    rnd, is_open = data.get("round"), data.get("round_open", False)
    _check(rnd is None or _int(rnd), "round", "must be null or an integer >= 0", rnd, p)
    _check(isinstance(is_open, bool), "round_open", "must be true or false", is_open, p)
    _check(not (is_open is True and rnd is None), "round_open", "true with no round number", is_open, p)
    v = data.get("weight_version")
    _check(v is None or _int(v), "weight_version", "must be null or an integer >= 0", v, p)
    # epoch: epoch_problem (a bad one is dropped alone by `load`)
    ck = data.get("checkpoint")
    _check(ck is None or isinstance(ck, str), "checkpoint", "must be null or a path", ck, p)
    # weight_fingerprint: fingerprint_problem (a bad one is dropped alone by `load`)
    b = data.get("boot_id")
    _check(b is None or isinstance(b, str), "boot_id", "must be null or a string", b, p)
    jp = data.get("journal_path")
    _check(jp is None or isinstance(jp, str), "journal_path", "must be null or a path", jp, p)
    router = data.get("router")
    if router is not None:
        if not isinstance(router, dict):
            p.append(f"router: must be an object, got {router!r:.80}")
        else:
            _check(_int(router.get("pid"), 1, PID_MAX), "router.pid", f"must be a pid, 1..{PID_MAX}", router.get("pid"), p)
            _check(_int(router.get("start_time")), "router.start_time", "must be an integer >= 0",
                   router.get("start_time"), p)
            _check(_int(router.get("port"), 1, 65535), "router.port", "must be a TCP port, 1..65535",
                   router.get("port"), p)
            for key in ("fingerprint", "log_path"):
                _check(isinstance(router.get(key), str), f"router.{key}", "must be a string", router.get(key), p)
    engines = data.get("engines")
    if not isinstance(engines, dict):
        p.append(f"engines: must be an object of engine entries, got {engines!r:.80}")
        return p
    for name, e in engines.items():
        w = f"engines.{name}"
        if not isinstance(e, dict):
            p.append(f"{w}: must be an object, got {e!r:.80}")
            continue
        _check(e.get("state", "STOPPED") in _STATES, f"{w}.state", "must be an engine state", e.get("state"), p)
        for key in ("incarnation", "restarts"):
            _check(_int(e.get(key, 0)), f"{w}.{key}", "must be an integer >= 0", e.get(key), p)
        vv = e.get("verified_version")
        _check(vv is None or _int(vv), f"{w}.verified_version", "must be null or an integer >= 0", vv, p)
        for key in ("retired", "operator_stopped"):
            _check(isinstance(e.get(key, False), bool), f"{w}.{key}", "must be true or false", e.get(key), p)
        if e.get("pid") is not None:  # a process: never named without what verifies it
            _check(_int(e["pid"], 1, PID_MAX), f"{w}.pid", f"must be a pid, 1..{PID_MAX}", e["pid"], p)
            _check(_int(e.get("start_time")), f"{w}.start_time", "must be an integer >= 0", e.get("start_time"), p)
            _check(_int(e.get("port", 1), 1, 65535), f"{w}.port", "must be 1..65535", e.get("port"), p)
            lp = e.get("log_path", "")
            _check(isinstance(lp, str), f"{w}.log_path", "must be a path", lp, p)
            sa = e.get("spawned_at")
            _check(sa is None or isinstance(sa, (int, float)) and not isinstance(sa, bool) and 0 <= sa < 2**40,
                   f"{w}.spawned_at", "must be a wall-clock time", sa, p)
        fp = e.get("fingerprint")
        _check(fp is None or isinstance(fp, str), f"{w}.fingerprint", "must be a string", fp, p)
        why = e.get("reason")
        _check(why is None or isinstance(why, str), f"{w}.reason", "must be a string", why, p)
    return p


def fingerprint_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with a journal's weight_fingerprint (None: nothing, or none there; an
    older daemon's journal has none: engines are checked by their label alone)."""
    wf, v = data.get("weight_fingerprint"), data.get("weight_version")
    if wf is None:
        return None
    if not isinstance(wf, dict) or wf.get("version") != v or v is None:
        return f"weight_fingerprint: must be an object whose version is weight_version ({v!r}), got {wf!r:.80}"
    try:
        parse_fingerprint({k: x for k, x in wf.items() if k != "version"})
    except FingerprintError as bad:
        return f"weight_fingerprint: {bad}"
    return None


def epoch_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with a journal's epoch (None: nothing, or none there: an older daemon's)."""
    ep = data.get("epoch")
    if ep is None or _int(ep, 0, EPOCH_MAX):
        return None
    return f"epoch: must be null or an integer 0..{EPOCH_MAX}, got {ep!r:.80}"


def fingerprint_of(data: dict[str, Any]) -> Fingerprint | None:
    """The current version's fingerprint in a journal that `validate` passed (None: none)."""
    wf = data.get("weight_fingerprint")
    return None if wf is None else parse_fingerprint({k: x for k, x in wf.items() if k != "version"})


def copied_from(data: dict[str, Any], path: Path) -> str | None:
    """Where a journal read at `path` was written, if elsewhere (a state_dir copied from another
    daemon: its pids are that daemon's processes); None if here, or unrecorded (an older daemon's
    journal, trusted as before)."""
    there = data.get("journal_path")
    return there if there is not None and there != str(path.absolute()) else None


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)  # the rename itself survives a power cut
    finally:
        os.close(dirfd)


def load(path: Path, *, warn: bool = True) -> dict[str, Any] | None:
    """The journal, or None if there is none. JournalError if it cannot be trusted. A bad
    weight_fingerprint or epoch is dropped alone (said if `warn`)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise JournalError(f"cannot read {path}: {e}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise JournalError(f"{path} is not UTF-8 text ({e})") from None
    except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." thousands deep
        raise JournalError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise JournalError(f"{path} is not a format-{FORMAT} journal")
    problems = validate(data)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise JournalError(f"{path} does not fit the journal's schema: {'; '.join(problems[:3])}{more}")
    bad = fingerprint_problem(data)
    if bad is not None:  # only the fingerprint is lost: the version, round and engines are kept
        del data["weight_fingerprint"]
        if warn:
            log.warning("journal.fingerprint_dropped", path=str(path), problem=bad,
                        action=("the rest of the journal is kept; engines are checked by their version label until "
                                "the trainer publishes the current version again with its fingerprint"))
    bad = epoch_problem(data)
    if bad is not None:  # the next epoch starts from the wall clock alone (policy.starting_epoch)
        del data["epoch"]
        if warn:
            log.warning("journal.epoch_dropped", path=str(path), problem=bad,
                        action="the rest of the journal is kept; the membership epoch starts from the wall clock")
    return data


def engines_to_adopt(path: Path) -> int:
    """How many engines the journal at `path` names with a pid (a process a previous daemon
    left running): 0 when there is none or it cannot be trusted (the daemon then starts clean)."""
    try:
        data = load(path, warn=False)
    except JournalError:
        return 0
    return 0 if data is None else sum(1 for e in data["engines"].values() if "pid" in e)


class JournalWriter(Listener):
    """Writes the journal when the fleet changed, at most every `min_interval` seconds; a new
    membership epoch at once, before any consumer can read it (a bus listener while started).

    `write()` (awaited: a spawned engine's pid, the periodic write) takes the snapshot on the
    loop and leaves json.dump and the fsyncs to one writer thread, so a slow disk (a trainer's
    checkpoint) never stalls heartbeats or the control socket; `flush()` (whoever cannot await:
    the bus listener, close) writes on the caller's thread. Every snapshot gets a sequence
    number on the loop, and both write under one lock, the newest requested, only if newer than
    the last attempted: the file is never an older snapshot after a newer one."""

    def __init__(self, fleet: Fleet, path: Path, min_interval: float = 0.1, *, router: RouterLink | None = None):
        self.fleet = fleet
        self.router = router  # with [router]: its spawned process is journaled too
        self.path = path
        self.min_interval = min_interval
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._writing = False  # between start() and close()
        self.writes = 0
        self._lock = threading.Lock()  # one write at a time, and _attempted with it
        self._seq = 0  # the newest snapshot taken (on the loop thread only)
        self._attempted = 0  # the newest snapshot written, or whose write failed (logged)
        self._pending: tuple[int, dict[str, Any]] | None = None  # the newest handed to the thread
        self._thread: ThreadPoolExecutor | None = None  # created at the first write(), gone at close()
        self._last: asyncio.Future[None] | None = None  # the thread's newest job, for close()
        self._closed = False

    def mark(self) -> None:
        self._dirty.set()

    def start(self, tasks: TaskSet | None = None) -> None:
        """Write on every mark(), in a task of `tasks` (the daemon's) if given; close() ends it."""
        self._closed = False
        self._task = (tasks.spawn(self._run(), name="journal") if tasks is not None
                      else asyncio.create_task(self._run(), name="journal"))
        if not self._writing:
            self._writing = True
            self.fleet.bus.add_listener(self)

    def on_membership(self, routable: frozenset[str]) -> None:
        # The epoch moved in this turn; the event that says so reaches subscribers after it.
        # Synchronous: a listener cannot await, and the bus hands the event on when it returns.
        if self._writing:
            self.flush()

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await self.write()
            await asyncio.sleep(self.min_interval)

    def _take(self) -> tuple[int, dict[str, Any]]:
        """The fleet as it is now, numbered (loop thread: it reads loop-owned state)."""
        self._seq += 1
        return self._seq, snapshot(self.fleet, self.router, path=self.path)

    async def write(self) -> None:
        """Returns once a snapshot at least as new as the fleet now is on disk (or its write
        failed: logged, never raised), the loop free meanwhile. Requests that come while the
        thread writes are coalesced into one write of the newest."""
        if self._closed:  # after close(): no thread is started again
            self.flush()
            return
        self._pending = self._take()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vime-journal")
        job = self._last = asyncio.wrap_future(self._thread.submit(self._write_pending))
        # Shielded: a cancelled runner leaves the write to finish (close() waits for it).
        await asyncio.shield(job)

    def _write_pending(self) -> None:
        with self._lock:
            pending = self._pending  # the newest requested so far, read once
            if pending is not None and pending[0] > self._attempted:
                self._write(*pending)

    def flush(self) -> None:
        """Write the fleet as it is now, on this thread (after any write the thread is doing)."""
        seq, data = self._take()
        with self._lock:
            self._write(seq, data)

    def _write(self, seq: int, data: dict[str, Any]) -> None:  # under self._lock
        self._attempted = seq
        try:
            write_atomic(self.path, data)
            self.writes += 1
        except OSError as e:  # a full disk must not take the daemon down; say so loudly
            # The epoch served goes on; the next daemon's wall-clock floor keeps it ahead.
            log.error("journal.write_failed", path=str(self.path), error=str(e), epoch=data.get("epoch"))

    async def close(self) -> None:
        """The thread's last write, then a final one of the fleet as it is, then no thread left."""
        self._writing = False
        self._closed = True
        await cancel_and_wait(self._task)
        if self._last is not None:
            await asyncio.wait({self._last})
            self._last = None
        self.flush()
        if self._thread is not None:
            self._thread.shutdown(wait=True)  # its jobs are done: the flush above held the lock after them
            self._thread = None
