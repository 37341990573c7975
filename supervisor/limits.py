"""The daemon's open-file limit: raised to the hard limit at start, checked against the fleet.

Every engine costs the daemon descriptors: the heartbeat's kept connection, aiohttp's pool
beside it (health, /metrics, the version check: up to 4 per engine, daemon.py's connector),
a one-off connection while a probe is still in flight, the warm-up's concurrent requests
while a new incarnation starts, a pidfd for an adopted engine. With the soft limit many
distributions still default to (1024; 256 in some containers) and a few hundred engines,
connects fail with EMFILE and no engine reaches RUNNING. So `raise_nofile` lifts the soft
limit to the hard one at start (safe: the daemon and uvloop use epoll, never select(), and
vLLM raises its own soft limit anyway), and `nofile_problem` says, in one line, what to
raise when even the hard limit is below what the engine count needs.

Measured with a daemon supervising stand-in engines (harness/standin_engine.py), its
/proc/PID/fd counted every 20 ms from start to 8 s after READY=1: 18 with one engine; attached
engines 2 each (50: 116, 200: 417); spawned engines 2 each once running and about 10 each
while they all warm up at once (warm-up requests 8; 50 engines: peak 516). The estimate
below is an upper bound of that, with room for late probes and adopted engines' pidfds.
"""

from __future__ import annotations

import resource

# Descriptors per engine at the worst moment, first starts of the whole fleet at once: the
# heartbeat connection (1), aiohttp's pool for health, /metrics and /weight_info (up to 4),
# a one-off connection beside a probe still in flight (1), a pidfd for an adopted engine
# (1). The warm-up adds its concurrent requests, counted apart (warmup_requests).
PER_ENGINE = 7
# The daemon alone: the interpreter, stdio, epoll and signal pipes, the lock files, the
# control socket and a few of its clients (each event stream holds one), the metrics
# listener, the journal write, log tails read for post-mortems.
BASE = 64
# What RLIM_INFINITY (or a hard limit above it) becomes: the kernel's own ceiling on a
# process' descriptors, fs.nr_open; setrlimit refuses anything above it.
NR_OPEN_PATH = "/proc/sys/fs/nr_open"
NR_OPEN_DEFAULT = 1 << 20  # the kernel's default nr_open, when /proc cannot say


def nr_open() -> int:
    try:
        with open(NR_OPEN_PATH) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return NR_OPEN_DEFAULT


def soft_target(soft: int, hard: int, ceiling: int) -> int | None:
    """The soft limit to set, or None to leave it: the hard limit, an infinite one (or one
    above the kernel's ceiling) counting as `ceiling` (fs.nr_open); never lowered."""
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    return target


def raise_nofile() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (soft_target). Returns (soft, hard) as
    they are afterwards; a refused raise (a sandbox that forbids setrlimit) leaves them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = soft_target(soft, hard, nr_open())
    if target is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def nofile_needed(n_engines: int, warmup_requests: int = 8) -> int:
    """Descriptors the daemon may hold with `n_engines` engines, all starting at once (the
    first start of a fleet): BASE + n_engines x (PER_ENGINE + warmup_requests)."""
    return BASE + max(0, n_engines) * (PER_ENGINE + max(0, warmup_requests))


def nofile_problem(n_engines: int, soft: int, *, hard: bool = False, warmup_requests: int = 8) -> str | None:
    """One line saying what to raise when the open-file limit `soft` (the hard one, with
    hard=True) is below what `n_engines` engines need; None when it is enough."""
    need = nofile_needed(n_engines, warmup_requests)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    which = "hard" if hard else "soft"
    fix = (f"set LimitNOFILE={need} (or more) in the unit (systemctl edit vime-supervisor), or ulimit -Hn {need} "
           "as root before starting it" if hard else
           f"the daemon raises the soft limit to the hard one at start; raise both with LimitNOFILE={need} in "
           f"the unit, or ulimit -n {need} in the shell that starts it")
    return (f"the {which} open-file limit is {soft}, below the {need} descriptors {n_engines} engine(s) may need "
            f"(about {PER_ENGINE + max(0, warmup_requests)} per engine while they start, {BASE} for the daemon); "
            f"{fix}")
