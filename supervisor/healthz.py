"""The verdicts of the probe endpoints Kubernetes asks on the metrics listener (the same paths as
the Kubernetes API server's): pure, read from what the daemon knows at the time of the call.

    /livez     the daemon's event loop answers. Never fails because an engine is unhealthy:
               restarting the daemon does not heal an engine (the daemon already restarts it),
               and it would lose the adopted fleet's state for nothing.
    /readyz    the first fleet is up and routable engines meet min_healthy.
    /startupz  every engine's first start has concluded: the rule of sd_notify's READY=1.

200 with "ok: ..." or 503 with why, one line of text.
"""

from __future__ import annotations

LIVEZ, READYZ, STARTUPZ = "/livez", "/readyz", "/startupz"


def live(loop_lag_max: float) -> tuple[bool, str]:
    return True, f"ok: the event loop answers (largest lag over the last minute {loop_lag_max:.3f} s)"


def startup(started: bool) -> tuple[bool, str]:
    if started:
        return True, "ok: every engine's first start has concluded"
    return False, "first starts in progress: not every engine's first start has concluded"


def ready(started: bool, routable: int, min_healthy: int) -> tuple[bool, str]:
    if not started:
        return startup(started)
    if routable < min_healthy:
        return False, f"below min_healthy: {routable} routable engines, min_healthy {min_healthy}"
    return True, f"ok: {routable} routable engines, min_healthy {min_healthy}"
