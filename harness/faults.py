"""Faults on demand for the chaos loop, and what the daemon's event stream says happened next.

The kinds (kill, hang, push; the soak's kill-gap, crash-start, poison-reload, disconnect,
daemon; kill-mid-push, stop-mid-push, trainer-dies-mid-push inside a broadcast; and the soak's
forged-push, another version's tensors pushed under the version's label) are
described in docs/testing.md. They act on real processes (pids from the daemon's status) on
this host. `timeline()` reads, from the daemon's events after an injection, when the fault was
detected, when the engine was back and when it was RUNNING on verified current weights; it reads
each transition's structured `cause`, never its reason (which is for people).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from vime.harness.local_daemon import child_pids
from vime.supervisor.engine.process import proc_stat
from vime.supervisor.protocol import Cause, Event, State

MID_PUSH = ("kill-mid-push", "stop-mid-push", "trainer-dies-mid-push")  # during the step's broadcast
KINDS = ("kill", "hang", "push", "kill-gap", "crash-start", "poison-reload", "disconnect", "daemon", *MID_PUSH,
         "forged-push")
WHAT = {"kill": "kill -9 of the API server", "hang": "SIGSTOP of the EngineCore",
        "push": "weight push failing midway", "kill-gap": "kill -9 in the round gap",
        "crash-start": "engine crashing at start", "poison-reload": "checkpoint reload poisoned",
        "disconnect": "trainer disconnect mid-round", "daemon": "kill -9 of the daemon",
        "kill-mid-push": "kill -9 of receiver mid-push", "stop-mid-push": "SIGSTOP of receiver mid-push",
        "trainer-dies-mid-push": "trainer killed mid-push", "forged-push": "wrong tensors, label set"}
IN_ROUND = ("kill", "hang", "crash-start", "daemon")  # injected while a round has requests in flight
NO_ENGINE = ("disconnect", "daemon")                   # faults of the trainer or the daemon itself
# The transition cause each engine fault must be detected with (a kill -9 seen as a hang is wrong).
# A receiver stopped mid-push answers no probe (hang); the receivers of a trainer that died stay
# paused past the announced push's deadline (paused). A forged push (another version's tensors
# answered 200 under the version's label: the soak's) is caught by the version's fingerprint.
DETECTED_AS = {"kill": Cause.EXIT, "kill-gap": Cause.EXIT, "crash-start": Cause.EXIT, "poison-reload": Cause.EXIT,
               "hang": Cause.HANG, "push": Cause.POISONED, "kill-mid-push": Cause.EXIT,
               "stop-mid-push": Cause.HANG, "trainer-dies-mid-push": Cause.PAUSED,
               "forged-push": Cause.FINGERPRINT}
# What a fault must have done for the soak to count it (Fault.confirmed true), not only be seen.
MUST_CONFIRM = ("crash-start", "poison-reload", "push", *MID_PUSH, "forged-push")


@dataclass
class Fault:
    kind: str
    step: int                        # the step asked for
    engine: str | None = None
    fired_step: int | None = None    # the step it was injected at (later when it had to wait)
    injected_at: float | None = None  # wall clock
    pid: int | None = None
    incarnation: int | None = None
    note: str = ""
    confirmed: bool | None = None    # the fault did what it is for (requests in flight, the start
                                     # crashed, the reload failed, the push was poisoned)
    detected_at: float | None = None
    detected_as: str | None = None   # the transition's state and reason, for people
    detected_cause: str | None = None  # the transition's cause (DETECTED_AS says which is right)
    ready_at: float | None = None    # the restarted engine answered (STALE or RUNNING)
    resynced_at: float | None = None  # RUNNING on the current weights, verified (or, where a
                                      # spare took its place, back as the warm spare)
    resync_reason: str | None = None
    gap_at: float | None = None      # the round gap the daemon could act in (an in-round fault:
                                     # the round's end; otherwise the injection)
    spare: str | None = None         # the warm spare promoted into the engine's place
    full_at: float | None = None     # the spare RUNNING on the current weights, verified
    events: list[dict[str, Any]] = field(default_factory=list)

    def wrong_cause(self) -> str | None:
        """What is wrong with how the daemon saw this fault, if its cause is not the one expected."""
        want = DETECTED_AS.get(self.kind)
        if want is None or self.detected_at is None or self.detected_cause == want:
            return None
        return f"{self.kind} detected as {self.detected_cause!r}, not {want.value!r}"

    def after(self, t: float | None) -> float | None:
        return None if t is None or self.injected_at is None else t - self.injected_at

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "what": WHAT[self.kind], "step": self.step, "fired_step": self.fired_step,
                "engine": self.engine, "pid": self.pid, "incarnation": self.incarnation, "note": self.note,
                "injected_at": self.injected_at,  # wall clock: the goodput bench matches stops from it
                "confirmed": self.confirmed,
                "detected_after_s": self.after(self.detected_at), "detected_as": self.detected_as,
                "detected_cause": self.detected_cause,
                "ready_after_s": self.after(self.ready_at), "resynced_after_s": self.after(self.resynced_at),
                "resync_reason": self.resync_reason, "spare": self.spare,
                "full_after_gap_s": self.full_after_gap(), "place_back_after_s": self.after(self.place_back_at()),
                "filled_in_round": self.filled_in_round()}

    def place_back_at(self) -> float | None:
        """When the engine's place served again on verified current weights: the spare's
        promotion, else the engine's own resync."""
        return self.full_at if self.spare is not None else self.resynced_at

    def filled_in_round(self) -> bool:
        """A spare took the engine's place inside the round (`admit_mid_round`), before the gap."""
        return self.full_at is not None and (self.gap_at is None or self.full_at < self.gap_at)

    def full_after_gap(self) -> float | None:
        """Seconds from the gap the daemon could act in to the fleet at full strength."""
        back = self.place_back_at()
        # Filled inside the round: already whole when the gap came.
        return None if back is None or self.gap_at is None else max(0.0, back - self.gap_at)


def kill_server(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def engine_core_pid(server_pid: int) -> int:
    """The VLLM::EngineCore child of a vLLM API server."""
    cores = child_pids(server_pid, "VLLM::EngineCor")
    if not cores:
        raise LookupError(f"no VLLM::EngineCore child under pid {server_pid}")
    return cores[0]


def hang_core(server_pid: int, core: int | None = None) -> int:
    """SIGSTOP of an engine's EngineCore (core: its pid, when already looked up; looked up
    again unless it is still that server's child, so a reused pid is never stopped)."""
    st = proc_stat(core) if core is not None else None  # one file: cheap just before a signal
    pid = st.pid if st is not None and st.ppid == server_pid else engine_core_pid(server_pid)
    os.kill(pid, signal.SIGSTOP)
    return pid


def kill_group(pid: int) -> None:
    """kill -9 of an engine's whole process group (the daemon starts each in its own group):
    the EngineCore goes with its server, so its sockets in a collective close at once."""
    os.killpg(pid, signal.SIGKILL)


def stop_group(pid: int) -> None:
    """SIGSTOP of an engine's whole process group: its part of a collective stalls and its
    server answers nothing (the daemon's SIGKILL of the group ends it)."""
    os.killpg(pid, signal.SIGSTOP)


def halfway(of: int) -> int:
    """The bucket count after which a mid-push fault fires: half of them, at least one."""
    return max(1, of // 2)


class AfterBucket:
    """A FleetSender/WeightSender `progress` hook that calls `act` once, when `after` buckets
    (default: half of them) are on the wire. It returns normally: the push goes on into the fault."""

    def __init__(self, act: Callable[[int, int], None], after: int | None = None) -> None:
        self.act, self.after = act, after
        self.fired = False

    def __call__(self, step: str, info: dict) -> None:
        if step != "bucket_sent" or self.fired:
            return
        if info["index"] + 1 >= (self.after if self.after is not None else halfway(info["of"])):
            self.fired = True
            self.act(info["index"] + 1, info["of"])


class FailHalfway:
    """A WeightSender `progress` hook that raises once half the buckets are on the wire."""

    def __init__(self) -> None:
        self.raised = False

    def __call__(self, step: str, info: dict) -> None:
        if step == "bucket_sent" and not self.raised and info["index"] + 1 >= max(1, info["of"] // 2):
            self.raised = True
            raise RuntimeError(f"injected: the trainer failed after {info['index'] + 1} of {info['of']} buckets")


def timeline(fault: Fault, events: Iterable[dict[str, Any]]) -> Fault:
    """Fill in detected/ready/resynced from the daemon's transitions after the injection, and,
    where a warm spare was promoted into the engine's place, which one and when it served."""
    if fault.injected_at is None or fault.engine is None:
        return fault
    events = list(events)
    if fault.kind == "daemon":  # back when the restarted daemon says hello on the stream
        for ev in events:
            if ev.get("event") == Event.HELLO and ev.get("ts", 0) >= fault.injected_at:
                fault.detected_at = fault.ready_at = fault.resynced_at = ev["ts"]
                fault.detected_as = fault.detected_as or "the restarted daemon answered (hello on the event stream)"
                fault.resync_reason = fault.resync_reason or "engines re-adopted"
                break
        return fault
    fault.events = []
    after = [ev for ev in events if ev.get("ts", 0) >= fault.injected_at - 0.01]
    fault.gap_at = fault.injected_at
    if fault.kind in IN_ROUND:  # the daemon acts on an in-round fault once the round ends
        fault.gap_at = next((ev["ts"] for ev in after if ev.get("event") == Event.ROUND_END), None)
    verified = False  # the engine's weights were verified since it came back
    spare_verified = False
    for ev in after:
        if ev.get("event") != Event.TRANSITION:
            continue
        to, frm, cause = ev.get("to_state"), ev.get("from_state"), ev.get("cause")
        if ev.get("engine") != fault.engine:
            # A spare promoted after the fault was seen takes the engine's place: in the gap, or
            # inside the round where the daemon says it admitted it there (`admit_mid_round`).
            in_round = "inside round" in ev.get("reason", "") and ev["ts"] >= (fault.detected_at or ev["ts"])
            if (fault.detected_at is None or fault.gap_at is None and not in_round
                    or fault.gap_at is not None and ev["ts"] < fault.gap_at and not in_round
                    or fault.full_at is not None or fault.spare is None and fault.resynced_at is not None):
                continue
            if fault.spare is None and cause == Cause.PROMOTED:
                fault.spare = ev["engine"]
            if ev.get("engine") == fault.spare:
                spare_verified = cause == Cause.VERIFIED or (spare_verified and to in (State.STALE, State.RUNNING))
                if to == State.RUNNING and (spare_verified or cause == Cause.PROMOTED):  # promoted already current
                    fault.full_at = ev["ts"]
            continue
        if fault.resynced_at is not None:
            continue
        fault.events.append(ev)
        if fault.detected_at is None:
            if to in (State.EXITED, State.UNHEALTHY):
                fault.detected_at, fault.detected_as = ev["ts"], f"{to}: {ev.get('reason', '')}"
                fault.detected_cause = cause
            continue
        if fault.ready_at is None and frm == State.STARTING and to in (State.STALE, State.RUNNING, State.STANDBY):
            fault.ready_at = ev["ts"]
        if to == State.STANDBY and cause == Cause.SPARE and fault.spare is not None:
            # A spare serves in its place: it is back as the warm spare (synced when promoted).
            fault.resynced_at, fault.resync_reason = ev["ts"], f"back as the spare; {fault.spare} serves in its place"
            continue
        # Verified, then RUNNING: at once, or (held while a round was open) released in the gap.
        verified = cause == Cause.VERIFIED or (verified and to in (State.STALE, State.RUNNING))
        if to == State.RUNNING and verified:
            fault.resynced_at, fault.resync_reason = ev["ts"], ev.get("reason", "")
    return fault


# -- a push in a child process (trainer-dies-mid-push) -------------------------------------

CHILD_BUCKET_BYTES = 256 << 10  # small buckets, so "after bucket k" is inside the transfer


def save_tensors(named: Iterable[tuple[str, Any]], path: Path) -> Path:
    """The loop's tensors, for the child push to load (torch.save of a name -> tensor dict)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({n: t.detach().cpu().contiguous() for n, t in named}, path)
    return path


def child_push_command(tensors: Path, urls: list[str], version: int, deadline_s: float) -> list[str]:
    return [sys.executable, "-m", "vime.harness.faults", "push", "--tensors", str(tensors),
            "--version", str(version), "--deadline", f"{deadline_s:.3f}", *urls]


def build_child_push(argv: list[str]) -> tuple[Any, list[str], dict[str, Any], int]:
    """(FleetSender, urls, tensors, version) from child_push_command's arguments (the sender
    prints each bucket sent as a JSON line on stdout, for the parent to kill it after bucket k)."""
    import torch

    from vime.weight_sync.broadcast import FleetSender

    ap = argparse.ArgumentParser(prog="python -m vime.harness.faults push")
    ap.add_argument("--tensors", type=Path, required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--deadline", type=float, required=True)
    ap.add_argument("urls", nargs="+")
    a = ap.parse_args(argv)
    tensors = torch.load(a.tensors, weights_only=True)

    def progress(step: str, info: dict) -> None:
        print(json.dumps({"step": step, **{k: v for k, v in info.items() if isinstance(v, (int, float, str))}}),
              flush=True)

    # The parent announced the push (with this deadline): the child does not announce again.
    sender = FleetSender(bucket_bytes=CHILD_BUCKET_BYTES, solo_bytes=None, transfer_timeout=a.deadline,
                         progress=progress, reuse_group=False)
    return sender, a.urls, tensors, a.version


def kill_child_after(cmd: list[str], timeout: float, after: int | None = None) -> tuple[bool, str]:
    """Run the child push and kill -9 it once `after` buckets (default half) are on the wire.
    (killed, what happened); the child is always reaped, killed at the latest after `timeout`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    watchdog = threading.Timer(timeout, proc.kill)  # a child that prints nothing is killed too
    watchdog.daemon = True
    watchdog.start()
    killed, what = False, "the child push ended before the fault"
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # one JSON line per progress step
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if info.get("step") == "bucket_sent" and info["index"] + 1 >= (after or halfway(info["of"])):
                proc.kill()
                killed, what = True, f"killed -9 after {info['index'] + 1} of {info['of']} buckets"
                break
        else:
            if watchdog.finished.is_set():
                what = f"no bucket {after or 'halfway'} within {timeout:g}s (killed then)"
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    return killed, what


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "push":
        print("usage: python -m vime.harness.faults push --tensors FILE --version V --deadline S URL...",
              file=sys.stderr)
        return 2
    sender, urls, tensors, version = build_child_push(argv[1:])
    results = sender.push(urls, tensors, version, redo=False)
    print(json.dumps({"step": "done", "results": {u: r.status for u, r in results.items()}}), flush=True)
    return 0 if all(r.ok for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
