"""`make test`: the suite in two pytest sessions at once. The tests that boot engines or load
the host (markers engine, cluster, heavy) run one after another in the foreground, niced;
beside them the light ones (sockets, stand-ins, pure logic), which wait more than they compute,
write to a log that is printed after. The exit status is the heavy session's if it failed, else the light
one's (0 when both pass); 130 when stopped by a signal.

SIGINT or SIGTERM (Ctrl-C, CI's timeout) is passed to both sessions once, as SIGINT, so each
tears its fixtures down and stops what it started (each leads a process group of its own, so a
terminal's Ctrl-C reaches them through this script only); one still running 60 s later is
killed.

    python tests/streams.py [PYTEST ARGS...]    # the args go to both sessions
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HEAVY = "engine or cluster or heavy"
GRACE_S = 60.0
HEAVY_NICE = 5
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[1]
    log_path = root / ".venv" / "test-light.log" if (root / ".venv").is_dir() else root / "test-light.log"
    pytest = [sys.executable, "-m", "pytest"]
    with open(log_path, "w") as log:
        # The light session keeps no cache (.pytest_cache is the heavy one's: --lf knows its failures).
        light = subprocess.Popen([*pytest, "-p", "no:cacheprovider", "-m", f"not ({HEAVY})", *argv],
                                 cwd=root, stdout=log, stderr=subprocess.STDOUT, process_group=0)
        # Niced: the light stream's daemons answer probes with timeouts of a second or two, and
        # must get the CPU they ask for while an engine boots on every core.
        heavy = subprocess.Popen(["nice", "-n", str(HEAVY_NICE), *pytest, "-m", HEAVY, *argv], cwd=root,
                                 process_group=0)
        sessions = (heavy, light)
        stopping: list[float] = []  # the deadline, once a signal came

        def stop(signum: int, _frame: object) -> None:
            # Only passed on here: the waiting stays in the loop below (a wait inside a handler
            # would contend with the wait it interrupted for the Popen's lock).
            if not stopping:
                stopping.append(time.monotonic() + GRACE_S)
                for p in sessions:
                    signal_group(p, signal.SIGINT)  # as a terminal's Ctrl-C: the session's group

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        while any(p.poll() is None for p in sessions):
            if stopping and time.monotonic() > stopping[0]:
                for p in sessions:
                    signal_group(p, signal.SIGKILL)
            time.sleep(0.2)
        heavy_rc, light_rc = heavy.returncode, light.returncode
    print_light(log_path, light_rc)
    print(f"== exit: heavy stream {heavy_rc}, light stream {light_rc}")
    if stopping:
        return 130
    # pytest's 5: no test selected, as a stream is when the arguments name only the other's.
    rcs = [rc for rc in (heavy_rc, light_rc) if rc != NO_TESTS] or [NO_TESTS]
    return next((rc for rc in rcs if rc), 0)


def signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass  # gone since


def print_light(log_path: Path, rc: int | None) -> None:
    print(f"\n== the light stream, run beside it (not {HEAVY}): exit {rc}, log {log_path}", flush=True)
    sys.stdout.write(log_path.read_text(errors="replace"))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
