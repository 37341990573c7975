"""The membership diff, pure: what the router should gain and lose to match the daemon.

The daemon owns only its own engines' URLs. A URL in the router that is neither desired nor
the daemon's is `unknown` (another node's daemon, an operator's edit, a stray): reported as
drift, removed only when pruning is on (docs/router.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .base import normalize_url


@dataclass(frozen=True)
class Plan:
    add: tuple[str, ...]  # desired, not in the router
    remove: tuple[str, ...]  # ours, in the router, not desired (and unknown ones when pruning)
    unknown: tuple[str, ...]  # in the router, not ours

    @property
    def in_sync(self) -> bool:
        """Nothing to add or remove, nothing unknown: the router routes exactly where it should."""
        return not (self.add or self.remove or self.unknown)


def plan(desired: Iterable[str], listed: Iterable[str], own: Iterable[str], *,
         prune_unknown: bool = False, same: Mapping[str, str] | None = None) -> Plan:
    """`desired`: our URLs that may take traffic now; `listed`: the router's workers; `own`:
    every URL of ours (desired or not). URLs are compared normalized, and `same` maps a listed
    URL (normalized) to ours that it names under another host spelling (HostResolver). The plan
    names each URL as the router spells it when removing (every spelling of an engine that is
    out), as we do when adding."""
    same = same or {}
    want = {normalize_url(u): u for u in desired}
    mine = {normalize_url(u) for u in own} | set(want)
    have: dict[str, list[str]] = {}
    for u in listed:
        n = normalize_url(u)
        have.setdefault(same.get(n, n), []).append(u)
    add = tuple(sorted(want[n] for n in want.keys() - have.keys()))
    extra = sorted(n for n in have.keys() - want.keys())
    ours = tuple(u for n in extra if n in mine for u in have[n])
    unknown = tuple(u for n in extra if n not in mine for u in have[n])
    remove = ours + unknown if prune_unknown else ours
    return Plan(add=add, remove=remove, unknown=unknown)
