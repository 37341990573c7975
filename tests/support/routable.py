"""The routable list, sampled on a daemon's control socket while a test runs, so that an engine
routed for a moment is seen (an assertion on the list at one instant can miss it)."""

from __future__ import annotations

import threading
import time

from vime.supervisor.client import SupervisorClient


class RoutableSampler:
    """Reads the routable engines' names every `every` s until stopped: `samples` in order, and
    `at`, the wall-clock time each was answered (one answered before a transition's timestamp
    shows the fleet before it)."""

    def __init__(self, sock: str, every: float = 0.05):
        self.client = SupervisorClient(sock)
        self.every = every
        self.samples: list[list[str]] = []
        self.at: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                names = [e["name"] for e in self.client.routable_engines()["engines"]]
                self.at.append(time.time())
                self.samples.append(names)
            except Exception:  # not serving yet (starting up): nothing to sample
                pass
            self._stop.wait(self.every)

    def before(self, t: float) -> list[list[str]]:
        """The samples answered before wall-clock time `t`."""
        return [s for s, at in zip(self.samples, self.at) if at < t]

    def stop(self) -> list[list[str]]:
        self._stop.set()
        self._thread.join(10)
        return self.samples
