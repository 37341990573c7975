"""bench/weight_push.py --fleet, its short form: tiny sizes, up to 2 stand-in receivers."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the stand-ins need vLLM")
def test_fleet_short_form_prints_the_table_and_the_fault_rows():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "weight_push.py"), "--fleet", "1,2",
                          "--fleet-mb", "8", "--bucket-mb", "1", "--repeat", "1",
                          "--fault-rendezvous-s", "4"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    table = out.stdout.split("\n\n")[-1].splitlines()
    assert table[0].split()[:5] == ["receivers", "chain", "s", "tree", "s"]
    rows = {line.split()[0]: line.split() for line in table[2:] if line[:1].isdigit() or line.lstrip()[:1].isdigit()}
    assert set(rows) == {"1", "2"} and float(rows["2"][6]) == pytest.approx(1.58, abs=0.01)
    for sig in ("SIGKILL", "SIGSTOP"):
        line = next(x for x in table if x.startswith(sig))
        assert "survivors at the version 1/1" in line and "faulted one unreachable" in line, line


def _links_missing() -> str | None:
    """Why emulated links cannot be built here (root, iproute2's ip and tc, network
    namespaces), or None."""
    why = wp.link_preflight(os.geteuid())
    if why:
        return why
    probe = f"vime-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the stand-ins need vLLM")
def test_on_emulated_links_the_chain_into_4_costs_less_than_log2_5_of_one():
    """What docs/benchmarks.md claims where the links are the limit: each receiver and the
    trainer on a 100 Mbit/s link of its own, the chain into 4 receivers takes less than
    log2(5) = 2.32 times its push into one (a tree would send ceil(log2(5)) = 3 copies down the
    trainer's link, a sequential push 4). 8 MB: 0.7 s per transfer at 100 Mbit/s."""
    why = _links_missing()
    if why:
        pytest.skip(f"emulated links need root, network namespaces and tc: {why}")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "weight_push.py"), "--fleet", "1,4",
                          "--link-mbit", "100", "--fleet-mb", "8", "--ways", "chain", "--repeat", "1"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "links torn down" in out.stdout
    table = out.stdout.split("links EMULATED")[-1].splitlines()
    rows = {line.split()[0]: line.split() for line in table if line.strip()[:1].isdigit()}
    one, four = float(rows["1"][1]), float(rows["4"][1])
    assert one > 0.6  # 8 MB at 100 Mbit/s: the links are the limit (a loopback push takes 0.05 s)
    assert four / one < math.log2(5), (one, four)


# -- the emulated links' pure parts (no root needed: nothing is run) ---------------------------
wp = load_bench("weight_push")


def test_link_names_are_tagged_unique_and_fit_the_kernels_limit():
    links = wp.Links.for_pid(4194304, 8, 100)  # the largest pid Linux hands out
    devs, nss = links.devices(), links.namespaces()
    assert len(devs) == len(set(devs)) == 2 + 2 * 8 and len(nss) == len(set(nss)) == 1 + 8
    assert all(d.startswith("vl4194304") and len(d) <= 15 for d in devs)  # IFNAMSIZ - 1
    assert all(n.startswith("vl4194304") for n in nss)
    ips = [links.trainer_ip, *(links.receiver_ip(k) for k in range(8))]
    assert len(set(ips)) == 9 and ips[0] == "10.231.0.1" and ips[1] == "10.231.0.10"
    assert wp.Links.for_pid(4194305, 1, 100).subnet != links.subnet  # pids next to each other
    with pytest.raises(ValueError):
        wp.Links.for_pid(1, 0, 100)
    with pytest.raises(ValueError):
        wp.Links.for_pid(1, 2, 0)


def test_setup_shapes_both_ends_of_every_link_and_teardown_removes_every_namespace():
    links = wp.Links.for_pid(77, 3, 50)
    setup = wp.link_setup_cmds(links)
    shaped = {(c[c.index("-n") + 1] if "-n" in c else None, c[c.index("dev") + 1])
              for c in setup if c[0] == "tc"}
    ends = {(None, links.trainer_dev), (links.bridge_ns, links.trainer_peer)}
    for k in range(3):
        ends |= {(links.receiver_ns(k), links.receiver_dev(k)), (links.bridge_ns, links.receiver_peer(k))}
    assert shaped == ends  # each link shaped in both directions, nothing else
    for c in setup:
        if c[0] == "tc":
            assert c[-8:-3] == ["root", "tbf", "rate", "50mbit", "burst"]
    # every receiver's address is set inside its own namespace, the trainer's in the root one
    addrs = [c for c in setup if "addr" in c]
    assert ["ip", "addr", "add", "10.231.77.1/24", "dev", links.trainer_dev] in addrs
    assert ["ip", "-n", links.receiver_ns(2), "addr", "add", "10.231.77.12/24", "dev",
            links.receiver_dev(2)] in addrs
    teardown = wp.link_teardown_cmds(links)
    deleted = {c[3] for c in teardown if c[:3] == ["ip", "netns", "del"]}
    assert deleted == set(links.namespaces())
    assert ["ip", "link", "del", links.trainer_dev] in teardown
    created = {c[c.index("add") + 1] for c in setup if c[:3] == ["ip", "netns", "add"]}
    assert created <= deleted


def test_preflight_refuses_without_root_or_iproute2():
    assert "root" in wp.link_preflight(1000, which=lambda t: "/sbin/" + t)
    assert "tc" in wp.link_preflight(0, which=lambda t: None if t == "tc" else "/sbin/ip")
    assert wp.link_preflight(0, which=lambda t: "/sbin/" + t) is None


def test_link_mode_refuses_a_non_root_user_before_building_anything(monkeypatch, capsys):
    monkeypatch.setattr(wp.os, "geteuid", lambda: 1000)  # the bench's view of who runs it
    monkeypatch.setattr(wp, "link_setup", lambda links: pytest.fail("built a network"))
    assert wp.fleet_with_links([1, 2], 1.0, 1, 1 << 20, 100) == 2
    assert "needs root" in capsys.readouterr().err


def test_fleet_table_ratios_against_one_receiver():
    rows = [wp.FleetRow(1, 2.0, 2.0, 2.0, 0.04, 0.05, 0.03),
            wp.FleetRow(8, 2.5, 8.0, 16.0, 0.1, 0.2, 0.05)]
    table = wp.fleet_table(rows)
    assert table[0] == wp.FLEET_HDR and set(table[1]) == {"-"}
    eight = table[3].split()
    assert eight[:9] == ["8", "2.500", "8.000", "16.000", "1.25", "4.00", "3.17", "8.00", "6.40"]
    assert eight[9:] == ["0.10", "0.20", "0.05"]
    no_one = wp.fleet_table(rows[1:])[2].split()  # no N=1 row: no ratio to it
    assert no_one[4] == no_one[5] == no_one[7] == "-"
