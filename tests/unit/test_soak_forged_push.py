"""The long soak's forged push (harness/soak.py): its place in the catalogue and the schedule,
and the verdict "caught, never routed" read from the daemon's events (no engine: the forgery
on real engines is the long soak's, and tests/engine/test_fingerprint_real.py's in CI)."""

from __future__ import annotations

from vime.harness import faults, soak
from vime.supervisor.protocol import Cause, Event


def test_the_long_form_forges_a_push_the_ci_short_form_does_not():
    assert "forged-push" in faults.KINDS and "forged-push" in faults.MUST_CONFIRM
    assert faults.DETECTED_AS["forged-push"] is Cause.FINGERPRINT
    assert len(faults.WHAT["forged-push"]) < 30  # the faults table's column
    assert "forged-push" in soak.LONG and "forged-push" not in soak.SHORT
    assert [f.kind for f in soak.schedule(soak.LONG * 2, seed=7)].count("forged-push") == 2


def _fault(**kw) -> faults.Fault:
    base = dict(engine="engine-1", injected_at=100.0, detected_at=101.0, detected_cause=Cause.FINGERPRINT.value,
                resynced_at=130.0)
    return faults.Fault("forged-push", 4, **{**base, **kw})


def _events(*routable_at: tuple[float, list[str]]) -> list[dict]:
    evs = [{"event": Event.MEMBERSHIP.value, "ts": 99.0, "routable": ["engine-0", "engine-1"]},  # before: v-1
           {"event": Event.WEIGHTS_PUBLISHED.value, "ts": 100.5, "version": 5}]
    evs += [{"event": Event.MEMBERSHIP.value, "ts": ts, "routable": names} for ts, names in routable_at]
    return sorted(evs, key=lambda e: e["ts"])


def test_caught_and_never_routed_until_verified_again():
    ok, why = soak.forged_push_caught(_fault(), _events((100.6, ["engine-0"]), (131.0, ["engine-0", "engine-1"])))
    assert ok, why
    assert soak.forged_checks([(_fault(), ok, why)])["every forged push caught, never routed"][0]


def test_routed_after_the_publish_is_not_caught():
    ok, why = soak.forged_push_caught(_fault(), _events((100.6, ["engine-0", "engine-1"])))
    assert not ok and "listed routable at [0.6] s" in why
    check = soak.forged_checks([(_fault(), ok, why)])["every forged push caught, never routed"]
    assert check == (False, why)


def test_seen_with_another_cause_or_never_verified_again_is_not_caught():
    assert not soak.forged_push_caught(_fault(detected_cause=Cause.HANG.value), _events())[0]
    assert not soak.forged_push_caught(_fault(resynced_at=None), _events())[0]
    assert not soak.forged_push_caught(_fault(injected_at=None), _events())[0]
    assert soak.forged_checks([]) == {}
