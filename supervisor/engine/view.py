"""What the daemon's readers see of one engine: a Protocol that `engine.EngineRunner` meets.

For the modules the runner itself imports (postmortem.py), which therefore cannot import it
back, and for any reader that should not reach the runner's verbs.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Protocol

from ..config import Config, EngineSpec
from .fsm import EngineFSM
from ..states import ProbeOutcome
from .probes import Prober
from .process import ChildProcess
from ..states import State


class EngineView(Protocol):
    spec: EngineSpec
    cfg: Config
    fsm: EngineFSM
    prober: Prober
    log_path: Path | None
    probe_history: deque[tuple[float, ProbeOutcome]]
    retired: bool

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def proc(self) -> ChildProcess | None: ...

    @property
    def state(self) -> State: ...

    @property
    def incarnation(self) -> int: ...
