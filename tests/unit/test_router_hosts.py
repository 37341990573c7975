"""Another spelling of one worker's host is the same worker (router/base.HostResolver, the
plan's `same`): resolved once per host, cached with a bound, off the event loop."""

from __future__ import annotations

import asyncio

from vime.supervisor.router.base import HostResolver
from vime.supervisor.router.plan import plan

OURS = "http://127.0.0.1:8001"


def test_localhost_a_mapped_address_and_a_literal_are_one_host():
    async def main():
        r = HostResolver()
        same = await r.same_workers(["http://localhost:8001", "http://[::ffff:127.0.0.1]:8001/", OURS,
                                     "http://localhost:8002", "https://localhost:8001"], [OURS])
        assert same == {"http://localhost:8001": OURS, "http://[::ffff:127.0.0.1]:8001": OURS}
        # Nothing to resolve when every listed URL is spelled as ours.
        before = r.lookups
        assert await r.same_workers([OURS + "/"], [OURS]) == {}
        assert r.lookups == before

    asyncio.run(main())


def test_each_host_is_resolved_once_and_the_cache_is_bounded():
    async def main():
        r = HostResolver(bound=2)
        got = await asyncio.gather(*(r.addresses("localhost") for _ in range(5)))
        assert r.lookups == 1 and all("127.0.0.1" in a for a in got)
        await r.addresses("localhost")
        assert r.lookups == 1  # cached
        assert await r.addresses("10.1.2.3") == frozenset({"10.1.2.3"}) and r.lookups == 1  # a literal: no lookup
        await r.addresses("no-such-host.invalid")
        await r.addresses("ip6-localhost")
        assert len(r._cache) == 2 and "localhost" not in r._cache  # least recently used out
        assert await r.addresses("no-such-host.invalid") == frozenset({"no-such-host.invalid"})

    asyncio.run(main())


def test_a_listed_alias_of_ours_is_removed_when_not_routable_and_never_unknown():
    same = {"http://localhost:8001": OURS}
    p = plan([], ["http://localhost:8001", "http://LOCALHOST:8001/"], own=[OURS], same=same)
    assert p.remove == ("http://localhost:8001", "http://LOCALHOST:8001/") and p.unknown == ()
    kept = plan([OURS], ["http://localhost:8001"], own=[OURS], same=same)
    assert kept.add == () and kept.remove == () and kept.in_sync  # listed under another spelling: there
    assert plan([], ["http://localhost:8001"], own=[OURS]).unknown == ("http://localhost:8001",)  # unresolved
