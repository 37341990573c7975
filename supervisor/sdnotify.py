"""systemd's notify protocol (sd_notify(3)), in the few lines it takes (docs/deployment.md).

READY=1 once the control socket listens and every engine's first start has concluded; STATUS=
on every fleet change; WATCHDOG=1; STOPPING=1; EXTEND_TIMEOUT_USEC= while first starts run long;
RELOADING=1 before a re-exec. Nothing at all when NOTIFY_SOCKET is unset.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self._sock: socket.socket | None = None
        self._addr: str | bytes = ""
        if addr.startswith("@"):  # abstract namespace: a leading NUL byte on the wire
            self._addr = b"\0" + addr[1:].encode()
        elif addr.startswith("/"):
            self._addr = addr
        if self._addr:
            # Non-blocking: a notify socket nobody drains (its queue full) must cost a dropped
            # message, never the event loop (a blocking sendto wedged a daemon's shutdown).
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        # The watchdog is ours only if WATCHDOG_PID is unset or names this process.
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval: float | None = int(usec) / 2e6 if usec.isdigit() and mine and int(usec) > 0 else None
        self.last_status = ""

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *assignments: str) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(assignments).encode(), self._addr)
            return True
        except OSError:  # systemd went away or its queue is full (EAGAIN): never fatal, never waited on
            return False

    def ready(self, status: str) -> None:
        self.last_status = status
        self.notify("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        if text != self.last_status:
            self.last_status = text
            self.notify(f"STATUS={text}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> None:
        """The current start (or stop) may take `seconds` more from now: systemd moves its
        deadline there if that is later, and fails the unit if no READY=1 (or another
        extension) comes by then. Sent from the event loop, so a wedged daemon stops extending."""
        self.notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")

    def reloading(self) -> None:
        """Before a re-exec; READY=1 (ready()) when the new process answers. MONOTONIC_USEC is
        what systemd 253's Type=notify-reload asks for; older ones ignore it."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading (re-exec)")

    def stopping(self) -> None:
        self.notify("STOPPING=1", "STATUS=stopping engines")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
