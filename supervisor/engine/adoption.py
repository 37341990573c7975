"""What a previous daemon image left of one engine: a process taken over from its journal (a
daemon restart or a reload), or an attached engine it was serving. The runner reads it while
the engine is checked again, so a spare stays a spare and a serving engine keeps serving."""

from __future__ import annotations

from dataclasses import dataclass

from ..states import State
from .process import EngineProcess

S = State


@dataclass
class Adoption:
    proc: EngineProcess | None = None  # from the journal, taken by the first start
    routable: bool = False  # it was serving when the previous daemon died
    unwarmed: bool = False  # it was still STARTING: its warm-up may not have run
    standby: bool = False  # it was a spare: it stays one
    up: bool = False  # it had been up (not STARTING): a reload's socket waits for its check
    state: State | None = None  # the state the journal gave it when adopted
    age: float = 0.0  # seconds since its spawn, when it was adopted STARTING (first_wait goes on)
    after: str = ""  # "a daemon restart" or "a reload", for the transition's reason

    @classmethod
    def of(cls, proc: EngineProcess, state: str, *, after: str, age: float, spares: bool) -> Adoption:
        """`state`: one of the kept states' values (the journal's, checked by the caller);
        `age`: seconds since its spawn; `spares`: the fleet keeps spares."""
        unwarmed = state == S.STARTING.value
        return cls(proc=proc, routable=state in (S.RUNNING.value, S.SUSPECT.value), unwarmed=unwarmed,
                   standby=state == S.STANDBY.value and spares, up=not unwarmed, state=S(state),
                   age=age if unwarmed else 0.0, after=after)

    def take(self) -> EngineProcess | None:
        """The adopted process, handed over once (to the start, or to a stop before it)."""
        proc, self.proc = self.proc, None
        return proc
