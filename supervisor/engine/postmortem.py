"""Post-mortem before a kill: what an engine looked like, saved before it is stopped
(docs/operations.md).

For an engine about to be stopped as unhealthy or poisoned, whose start ran out of first_wait,
or whose stop outlived stop_timeout: one folder under `<log_dir>/incidents/` with incident.json
(why, its probe history, each process's state and CPU time), its log's tail, a `/metrics`
snapshot and a `py-spy dump` of each process when py-spy is installed. Bounded in time: a
wedged engine must not stall the daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from ..tasks import within
from . import retention
from .activity import sample_group
from .process import read_tail
from .view import EngineView

log = structlog.get_logger("vime.postmortem")


def incident_dir(log_dir: str) -> Path:
    return Path(log_dir) / "incidents"


# Folders being written now (two engines may be captured at once): retention leaves them alone.
_writing: set[Path] = set()


async def capture(runner: EngineView, reason: str, *, budget: float = 10.0) -> Path | None:
    """Save the incident folder; returns it (None if even creating it failed)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    folder = incident_dir(runner.cfg.log_dir) / f"{stamp}-{runner.name}-{runner.fsm.incarnation}"
    rule = retention.incidents_rule(runner.cfg)
    # Live before it exists: a prune that scans the folder (this capture's or a concurrent one's)
    # reads the live set after its scan, so it never removes a folder being written.
    _writing.add(folder)
    try:
        if folder.parent.is_dir():
            # Room first, so that incidents_keep holds while this one is written, not only after.
            await asyncio.to_thread(retention.prune_incidents, folder.parent, _writing, rule, 1)
        try:
            folder.mkdir(parents=True, exist_ok=False)
        except OSError as e:
            log.error("postmortem.failed", engine=runner.name, error=str(e))
            return None
        await _capture(runner, reason, folder, budget)
        # The oldest beyond incidents_keep(_bytes) go; this one and any still being written stay.
        await asyncio.to_thread(retention.prune_incidents, folder.parent, _writing, rule)
    finally:
        _writing.discard(folder)
    return folder


async def _capture(runner: EngineView, reason: str, folder: Path, budget: float) -> None:
    t0 = time.monotonic()
    group = sample_group(runner.proc.pid) if runner.proc is not None else None
    pids = [m.pid for m in group.members] if group is not None else []
    summary: dict[str, Any] = {
        "engine": runner.name, "incarnation": runner.fsm.incarnation, "reason": reason,
        "state": runner.fsm.state.value, "time": time.time(), "url": runner.spec.base_url,
        "pid": runner.pid, "group": pids,
        # What each process was doing: state (R running, S sleeping, D in I/O, T stopped) and
        # CPU seconds so far (its own plus its reaped children's).
        "processes": [{"pid": m.pid, "comm": m.comm, "state": m.state, "cpu_seconds": round(m.cpu, 2)}
                      for m in group.members] if group is not None else [],
        "probe_history": [
            {"at_monotonic": round(at, 3), "ok": o.ok, "detail": o.detail,
             "latency": None if o.latency is None else round(o.latency, 4)}
            for at, o in runner.probe_history
        ],
        "captured": [],
    }
    if runner.log_path is not None:
        (folder / "log_tail.txt").write_text(read_tail(runner.log_path, 64 * 1024))
        summary["captured"].append("log_tail.txt")
    try:
        await within(_slow_parts(runner, folder, pids, summary), budget)
    except asyncio.TimeoutError:
        summary["truncated"] = f"capture stopped after its {budget:g}s budget"
    summary["took"] = round(time.monotonic() - t0, 3)
    (folder / "incident.json").write_text(json.dumps(summary, indent=1))
    log.warning("postmortem.saved", engine=runner.name, folder=str(folder), took=summary["took"],
                captured=summary["captured"])


async def _slow_parts(runner: EngineView, folder: Path, pids: list[int], summary: dict) -> None:
    try:
        async with runner.prober.session.get(f"{runner.spec.base_url}/metrics",
                                             timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            (folder / "metrics.txt").write_text(await r.text())
            summary["captured"].append("metrics.txt")
    except (asyncio.TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as e:
        summary["metrics"] = f"no answer: {type(e).__name__}"
    pyspy = shutil.which("py-spy") or _beside_python("py-spy")
    if pyspy is None:
        summary["py_spy"] = "not installed"
        return
    for pid in pids:
        # --nonblocking: read the stacks without pausing the process (it may be SIGSTOPped).
        proc = await asyncio.create_subprocess_exec(
            pyspy, "dump", "--nonblocking", "--pid", str(pid),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await within(proc.communicate(), 5.0)
        except asyncio.TimeoutError:
            out = b"py-spy timed out after 5s\n"
        finally:  # also when the whole capture's budget runs out: never leave py-spy behind
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        (folder / f"py-spy-{pid}.txt").write_bytes(out)
        summary["captured"].append(f"py-spy-{pid}.txt")


def _beside_python(name: str) -> str | None:
    import sys

    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else None


def list_incidents(log_dir: str) -> list[dict[str, Any]]:
    root = incident_dir(log_dir)
    out: list[dict[str, Any]] = []
    if not root.is_dir():
        return out
    for folder in sorted(root.iterdir()):
        try:
            info = json.loads((folder / "incident.json").read_text())
        except (OSError, ValueError):
            continue
        out.append({"folder": str(folder), "engine": info.get("engine"), "incarnation": info.get("incarnation"),
                    "reason": info.get("reason"), "time": info.get("time"), "captured": info.get("captured", [])})
    return out
