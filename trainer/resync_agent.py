"""The trainer's resync agent: it answers the daemon's `sync_request` events by pushing the
current weights into the one restarted engine the daemon names (docs/weights.md).

    agent = ResyncAgent(SupervisorClient(), lambda: (published_version, model.named_parameters()),
                        lock=trainer_lock).start()
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from vime.supervisor.client import SupervisorClient, SupervisorError
from vime.supervisor.protocol import Event, Role

# () -> (version, named tensors). Called per sync: it must return the version the trainer
# has published and the tensors of exactly that version.
WeightsProvider = Callable[[], tuple[int, Iterable[tuple[str, torch.Tensor]]]]


@dataclass
class ResyncRecord:
    engine: str
    version: int
    ok: bool
    seconds: float
    error: str | None = None
    reply: Mapping[str, Any] = field(default_factory=dict)


class ResyncAgent:
    def __init__(self, client: SupervisorClient, weights: WeightsProvider, *, backend: str = "gloo",
                 lock: AbstractContextManager[Any] | None = None, on_sync: Callable[[ResyncRecord], None] | None = None,
                 master_address: str | None = None):
        """client: a SupervisorClient, or a vime.cluster.ClusterClient for engines on many
        nodes (the same verbs; engines named node/engine). master_address: the address of this
        node the engines join the push's process group at (default: WeightSender's)."""
        self.client = client
        self.weights = weights
        self.backend = backend
        self.master_address = master_address
        # Held during a push: the trainer takes it around its optimizer step so a push never
        # reads tensors that are being updated.
        self.lock = lock or threading.Lock()
        self.on_sync = on_sync
        self.history: list[ResyncRecord] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._published: object = None  # the last version the daemon announced (restore_version checks it)

    def start(self, wait: float = 10.0) -> "ResyncAgent":
        self._thread = threading.Thread(target=self._run, name="vime-resync-agent", daemon=True)
        self._thread.start()
        self._ready.wait(wait)  # connected and registered as an agent
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop answering; returns once a push in progress has ended (or after `timeout`)."""
        self._stop.set()
        self.client.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for ev in self.client.events(role=Role.AGENT):
                    if self._stop.is_set():
                        return
                    if ev.get("event") == Event.HELLO:
                        self.restore_version(ev.get("weight_version"))
                        self._ready.set()
                    elif ev.get("event") == Event.WEIGHTS_PUBLISHED:
                        self._published = ev.get("version")
                    elif ev.get("event") == Event.SYNC_REQUEST:
                        self.handle(ev)
            except SupervisorError:
                if self._stop.is_set():
                    return
                time.sleep(1.0)  # the daemon is restarting; events() gave up its retries

    def restore_version(self, daemon_version: Any) -> bool:
        """At each reconnect: a daemon that came back without its journal (lost, corrupt)
        knows no version, and would route engines on the base weights as current. The agent
        remembers the last version it saw published, and publishes it again. True if it did.
        (The weights provider is not asked: it is for syncs only, and may be costly.)"""
        version = self._published
        if not isinstance(version, int):
            return False
        if daemon_version is not None and not (isinstance(daemon_version, int) and daemon_version < version):
            return False
        try:
            self.client.publish_weights(version)
        except SupervisorError:
            return False  # the next reconnect tries again
        return True

    def handle(self, request: Mapping[str, Any]) -> ResyncRecord | None:
        """Push the current version into the one engine the daemon asked about."""
        from vime.weight_sync.sender import WeightSender

        engine, url, wanted = request["engine"], request["url"], request["version"]
        with self.lock:
            if self._stop.is_set():  # stopped while waiting for the trainer's step
                return None
            version, tensors = self.weights()
            if version != wanted:
                return None  # a newer version was published since: the daemon asks again
            try:
                self.client.sync_begin(engine, version)
            except SupervisorError:
                return None  # someone else took it, or it is no longer STALE
            t0 = time.monotonic()
            error = None
            try:
                with WeightSender(url, backend=self.backend, master_address=self.master_address) as sender:
                    sender.push(tensors, version)
            except Exception as e:  # reported to the daemon, which restarts the engine
                error = f"{type(e).__name__}: {e}"
        reply = self.client.sync_end(engine, version, ok=error is None, error=error)
        record = ResyncRecord(engine, version, error is None, time.monotonic() - t0, error, reply)
        self.history.append(record)
        if self.on_sync is not None:
            self.on_sync(record)
        return record
