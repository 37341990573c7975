"""The daemon's open-file limit: raised to the hard limit at start (`raise_nofile`), and checked
against what the fleet needs (`nofile_needed`, `nofile_problem`, what --check-config says).

Every engine costs descriptors (the heartbeat's connection, aiohttp's pool beside it, a late
probe's, the warm-up's requests, an adopted engine's pidfd); at a soft limit of 1024 a few
hundred engines fail to connect. The estimate is an upper bound of what bench/descriptors.py
measured; the rules (refused fresh start, exit 2; started anyway with engines to adopt) and the
figures are in docs/deployment.md and docs/benchmarks.md.
"""

from __future__ import annotations

import resource
from typing import Any, Sequence

# Descriptors per engine at the worst moment, first starts of the whole fleet at once: the
# heartbeat connection (1), aiohttp's pool for health, /metrics and /weight_info (up to 4),
# a one-off connection beside a probe still in flight (1), a pidfd for an adopted engine
# (1). The warm-up adds its concurrent requests, counted apart (warmup_requests).
PER_ENGINE = 7
# An attached engine (a url: no process, no warm-up): the heartbeat connection and aiohttp's
# kept one for /health and /weight_info (2, measured), plus one for a late probe's /metrics.
PER_ATTACHED = 3
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


def nofile_needed(n_engines: int, warmup_requests: int = 8, *, attached: int = 0) -> int:
    """Descriptors the daemon may hold with `n_engines` spawned engines, all starting at once
    (the first start of a fleet), and `attached` attached ones:
    BASE + n_engines x (PER_ENGINE + warmup_requests) + attached x PER_ATTACHED."""
    return (BASE + max(0, n_engines) * (PER_ENGINE + max(0, warmup_requests))
            + max(0, attached) * PER_ATTACHED)


def fleet_counts(specs: Sequence[Any]) -> tuple[int, int]:
    """(spawned, attached) among engine specs (config.EngineSpec: `spawned` is True for one
    the daemon starts)."""
    spawned = sum(1 for s in specs if s.spawned)
    return spawned, len(specs) - spawned


def nofile_problem(n_engines: int, soft: int, *, hard: bool = False, warmup_requests: int = 8,
                   attached: int = 0) -> str | None:
    """One line saying what to raise when the open-file limit `soft` (the hard one, with
    hard=True) is below what `n_engines` spawned and `attached` attached engines need; None
    when it is enough."""
    need = nofile_needed(n_engines, warmup_requests, attached=attached)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    which = "hard" if hard else "soft"
    fix = (f"set LimitNOFILE={need} (or more) in the unit (systemctl edit vime-supervisor), or ulimit -Hn {need} "
           "as root before starting it" if hard else
           f"the daemon raises the soft limit to the hard one at start; raise both with LimitNOFILE={need} in "
           f"the unit, or ulimit -n {need} in the shell that starts it")
    who = []
    if n_engines or not attached:
        who.append(f"{n_engines} spawned engine(s) about {PER_ENGINE + max(0, warmup_requests)} each while they start")
    if attached:
        who.append(f"{attached} attached engine(s) about {PER_ATTACHED} each")
    total = n_engines + attached
    return (f"the {which} open-file limit is {soft}, below the {need} descriptors {total} engine(s) may need "
            f"({', '.join(who)}, {BASE} for the daemon); {fix}")


def start_problem(n_engines: int, hard: int, *, warmup_requests: int = 8, attached: int = 0,
                  adopting: int = 0) -> tuple[bool, str | None]:
    """Whether a daemon may start under the hard limit `hard`, and the problem to report:
    (False, problem) refuses a fresh start whose hard limit cannot hold the fleet; with
    engines to adopt (`adopting`: live pids in its journal, or a re-exec's) it starts and
    reports (True, problem), since refusing would leave them running unsupervised."""
    problem = nofile_problem(n_engines, hard, hard=True, warmup_requests=warmup_requests, attached=attached)
    if problem is None:
        return True, None
    if adopting:
        return True, f"{problem}; starting anyway to adopt {adopting} running engine(s)"
    return False, problem
