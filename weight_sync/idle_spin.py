"""VIME_VLLM_IDLE_SPIN_S: its name and how its value is read, for the plugin that applies it in
each engine (vllm_plugin.py) and the daemon's config that refuses a bad one before any engine
starts. Plain Python: the daemon imports it without the plugin or vLLM."""

from __future__ import annotations

SPIN_ENV = "VIME_VLLM_IDLE_SPIN_S"
MAX_SPIN_S = 1.0  # vLLM's own: a bound above it would spin longer, not less


def spin_seconds(value: str) -> float | None:
    """VIME_VLLM_IDLE_SPIN_S's value: None when empty; ValueError unless plain ASCII seconds
    from 0 to 1."""
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value) if value.isascii() else -1.0
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_SPIN_S:  # NaN fails too
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ValueError(f"{SPIN_ENV}={shown!r}: give the seconds vLLM's queues spin before they sleep, "
                         f"a number from 0 to {MAX_SPIN_S:g} (vLLM's own), or leave it unset")
    return seconds
