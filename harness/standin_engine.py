"""The former name of harness/emulated_engine.py, the emulated engine (a PROTOCOL STAND-IN for
vLLM engines, not vLLM): `python harness/standin_engine.py --base-port P --count N` serves N
protocol-only emulated engines (time scale 0: they answer at once) in one process, and
`serve`, `make_app` and `free_port_range` are the emulated engine's. New code imports
vime.harness.emulated_engine."""

from __future__ import annotations

if __package__:
    from .emulated_engine import free_port_range, main, make_app, serve
else:  # run as a script: its folder is on sys.path
    from emulated_engine import free_port_range, main, make_app, serve  # type: ignore[no-redef,import-not-found]

__all__ = ["free_port_range", "make_app", "serve"]

if __name__ == "__main__":
    main()
