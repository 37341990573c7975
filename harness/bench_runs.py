"""What the emulated fleet's benches share (bench/goodput.py, goodput_sweep.py, goodput_validate.py,
fleet_soak.py): the --mtbf flag, the --only check of bench/goodput.py's policies, the --out check, each run's
folder kept or removed and the failed runs counted, and the JSON's first and last keys."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from vime.harness.fault_clock import HEADLINE_MTBF_S, STRESS_MTBF_S
from vime.harness.fleet_plan import policies

# Below one fault per engine-minute every engine is down more than it serves (a restart takes
# minutes of engine time): nothing to rank, and the spares sized for it would outnumber the fleet.
MIN_MTBF_S = 60.0

SYNC_BASE = "fault-free"  # every goodput run runs it: ETTR's baseline in sync mode, the async rows' wall reference


def policy_names(only: str | None, weights: str, *, weights_flag: bool = True) -> list[str]:
    """The policies bench/goodput.py runs for --only (None: every one of the weights mode) and
    --weights, in its order: the sync baseline first, then the sync rows, then the async
    baseline and rows. ValueError names an unknown policy and the known ones (with
    `weights_flag`, the --weights that has one of the other mode: a caller without that flag
    says so)."""
    every = policies(0, "both")  # the names do not depend on the spares
    offered = policies(0, weights)
    text = ",".join(offered) if only is None else only
    wanted = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))  # once each
    if not wanted:
        raise ValueError(f"no policy name in {only!r}: name them, comma-separated")
    unknown = sorted(set(wanted) - set(offered))
    if unknown:
        other = [n for n in unknown if n in every]
        if not weights_flag:
            raise ValueError(f"unknown policies {unknown}; known: {', '.join(offered)}")
        hint = (f"; {', '.join(other)} {'is' if len(other) == 1 else 'are'} of the other weights mode: "
                f"pass --weights {'sync' if weights == 'async' else 'async'} or both") if other else ""
        raise ValueError(f"unknown policies {unknown} with --weights {weights}; known: {', '.join(offered)}{hint}")
    names = [SYNC_BASE, *[n for n in wanted if not every[n].is_async and n != SYNC_BASE]]
    if weights != "sync":  # each async row after its baseline
        names += ["fault-free-async", *[n for n in wanted if every[n].is_async and n != "fault-free-async"]]
    return names


def mtbf_of(text: str) -> float:
    """--mtbf: headline (24 h), stress (1 h) or engine seconds per engine, at least MIN_MTBF_S."""
    if text == "headline":
        return HEADLINE_MTBF_S
    if text == "stress":
        return STRESS_MTBF_S
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mtbf takes headline, stress or seconds of engine time, not {text!r}")
    if not (math.isfinite(v) and v >= MIN_MTBF_S):
        raise argparse.ArgumentTypeError(f"--mtbf must be a finite number of engine seconds, at least "
                                         f"{MIN_MTBF_S:g} (one fault per engine-minute), not {text!r}")
    return v


def out_file_error(out: str) -> str | None:
    """Why a bench's --out (a JSON it writes when its runs end, hours later) cannot be written
    there, said at parse time; None when it can be."""
    path = Path(out)
    if path.is_dir():
        return f"--out {out} is a folder: name a file (the JSON) in it"
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        return f"--out {out}: the folder {parent} {what}: create it or name another"
    return None


def run_header(script: str, argv: Sequence[str]) -> dict[str, Any]:
    """A bench JSON's first keys: the command (bench/<script> and its arguments), the date, and
    the host's cores and load at the start (a loaded host's figures are suspect)."""
    return {"command": " ".join(["python", f"bench/{script}", *argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start"}


def keep_folder(tmp: Path, into: Path | None, *, symlinks: bool = False) -> None:
    """Copy a run's folder into `into` (None: nowhere; its sockets left out), then remove it."""
    if into is not None and tmp.exists():
        into.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, into / tmp.name, dirs_exist_ok=True, symlinks=symlinks,
                        ignore=shutil.ignore_patterns("*.sock"))
    shutil.rmtree(tmp, ignore_errors=True)


class RunFolders:
    """Each run's temporary folder and what becomes of it: copied under --keep when given, under
    `failed_dir` (--keep, else `failed_name` beside --out) when its run failed or is suspect,
    else removed; and the failed runs, a line each (the bench exits 1 on any)."""

    def __init__(self, keep: str | None, out: str, failed_name: str, *, symlinks: bool = False):
        self.keep = Path(keep) if keep else None
        self.failed_dir = self.keep or Path(out).resolve().parent / failed_name
        self.failed: list[str] = []
        self.symlinks = symlinks

    def broke(self, tmp: Path, line: str) -> None:
        """The run raised: counted failed, its folder kept."""
        self.failed.append(line)
        self.interrupted(tmp)

    def interrupted(self, tmp: Path) -> None:
        """The run was stopped (Ctrl-C, SIGTERM): its folder kept, the stop passed on by the caller."""
        keep_folder(tmp, self.failed_dir, symlinks=self.symlinks)

    def ran(self, tmp: Path, what: str, problems: Sequence[str], suspect: bool) -> None:
        """The run ended: its folder kept when --keep, a problem or `suspect` (a must-be-zero
        figure above 0) asks; a problem counts it failed."""
        into = self.failed_dir if self.keep is not None or suspect or problems else None
        keep_folder(tmp, into, symlinks=self.symlinks)
        if problems:
            self.failed.append(f"{what}: {problems}")


def finish(doc: dict[str, Any], out: str, t0: float, fails: Sequence[str], *, gap: str = "") -> int:
    """The JSON's last key (took_s, since `t0` on the monotonic clock) and the file written, the
    time and the failures printed (`gap` before, a blank line or none); the exit status, 1 on any."""
    doc["took_s"] = round(time.monotonic() - t0, 1)
    Path(out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"{gap}  took {doc['took_s']:.0f} s; JSON: {out}")
    for line in fails:
        print(f"  FAIL: {line}")
    return 1 if fails else 0
