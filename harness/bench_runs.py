"""What the emulated fleet's benches share (bench/goodput.py, goodput_sweep.py, goodput_validate.py,
fleet_soak.py): the --only check of bench/goodput.py's policies."""

from __future__ import annotations

from vime.harness.fleet_plan import policies

SYNC_BASE = "fault-free"  # every goodput run runs it: ETTR's baseline in sync mode, the async rows' wall reference


def policy_names(only: str | None, weights: str, *, weights_flag: bool = True) -> list[str]:
    """The policies bench/goodput.py runs for --only (None: every one of the weights mode) and
    --weights, in its order: the sync baseline first, then the sync rows, then the async
    baseline and rows. ValueError names an unknown policy and the known ones (with
    `weights_flag`, the --weights that has one of the other mode: a caller without that flag
    says so)."""
    every = policies(0, "both")  # the names do not depend on the spares
    offered = policies(0, weights)
    wanted = list(dict.fromkeys(n.strip() for n in (only or ",".join(offered)).split(",") if n.strip()))  # once each
    if not wanted:
        raise ValueError(f"no policy name in {only!r}: name them, comma-separated")
    unknown = sorted(set(wanted) - set(offered))
    if unknown:
        other = [n for n in unknown if n in every]
        if not weights_flag:
            raise ValueError(f"unknown policies {unknown}; known: {', '.join(offered)}")
        hint = (f"; {', '.join(other)} {'is' if len(other) == 1 else 'are'} of the other weights mode: "
                f"pass --weights {'sync' if weights == 'async' else 'async'} or both") if other else ""
        raise ValueError(f"unknown policies {unknown} with --weights {weights}; known: {', '.join(offered)}{hint}")
    names = [SYNC_BASE, *[n for n in wanted if not every[n].is_async and n != SYNC_BASE]]
    if weights != "sync":  # each async row after its baseline
        names += ["fault-free-async", *[n for n in wanted if every[n].is_async and n != "fault-free-async"]]
    return names
