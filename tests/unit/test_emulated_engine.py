"""The emulated engine (harness/emulated_engine.py, a protocol stand-in; not vLLM) without vLLM:
its timing model, its deterministic tokens (a continued request is token-equal to an
uninterrupted one), pause semantics, and its faults, real (signals) and emulated. Its protocol
is compared with a real engine's in tests/engine/test_emulated_protocol.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from vime.harness import emulated_engine as em
from vime.harness import emulated_model as em_model
from vime.harness.local_daemon import free_port

from support.polling import until, wait_until
from support.protocol_exchange import collapse, drift, shape, unmerge

FAST = {"boot_s": 0, "first_batch_s": 0, "step_base_s": 0.01, "step_per_seq_s": 0.0, "prefill_token_s": 0.0}


class Running:
    """An emulated engine served on this test's event loop."""

    def __init__(self, engine: em.EmulatedEngine):
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> "Running":
        self.runner = await em.serve_one(self.engine, "127.0.0.1", self.port, announce=False)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        await self.runner.cleanup()
        if self.engine._loop_task is not None:
            self.engine._loop_task.cancel()

    async def post(self, path: str, body: dict | None = None, **kw) -> tuple[int, dict]:
        async with self.session.post(self.url + path, json=body, **kw) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str, **kw) -> tuple[int, str]:
        async with self.session.get(self.url + path, **kw) as r:
            return r.status, await r.text()

    async def stream(self, body: dict) -> list[dict | str]:
        out: list[dict | str] = []
        async with self.session.post(self.url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            async for raw in r.content:
                line = raw.decode().strip()
                if line:
                    out.append("[DONE]" if line == "data: [DONE]" else json.loads(line.removeprefix("data: ")))
        return out


def engine(**params: float) -> em.EmulatedEngine:
    return em.EmulatedEngine(model="tiny", exit_on_death=False, params={**FAST, **params})


def req(prompt, n: int, **more) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": n, "return_token_ids": True, "logprobs": 1, **more}


# -- the timing model -------------------------------------------------------------------------------


def test_step_time_is_base_plus_per_sequence_plus_prefill():
    p = em.parameters({"step_base_s": 0.006, "step_per_seq_s": 1e-4, "prefill_token_s": 1e-5, "first_batch_s": 30})
    assert em.step_time(p, 1, 0, False) == pytest.approx(0.0061)
    assert em.step_time(p, 100, 0, False) == pytest.approx(0.016)
    assert em.step_time(p, 1, 1000, False) == pytest.approx(0.0161)  # a continuation pays its recompute
    assert em.step_time(p, 1, 0, True) == pytest.approx(30.0061)


def test_a_request_weighs_seqs_per_request_sequences_in_the_step_and_the_capacity():
    p = em.parameters({"step_base_s": 0.006, "step_per_seq_s": 1e-4, "prefill_token_s": 1e-5,
                       "seqs_per_request": 64})
    assert em.step_time(p, 2, 0, False) == pytest.approx(0.006 + 1e-4 * 128)
    assert em.step_time(p, 1, 10, False) == pytest.approx(0.006 + 1e-4 * 64 + 1e-5 * 640)
    assert em.EmulatedEngine(params={"seqs_per_request": 64}, max_num_seqs=1024).capacity == 16


def test_the_scheduling_delay_quantile_is_its_buckets_upper_bound():
    le = [0.001, 0.01, 0.1]
    assert em_model.delay_quantile(le, [0, 0, 0, 0], 0.99) == 0.0
    assert em_model.delay_quantile(le, [98, 1, 1, 0], 0.99) == 0.01
    assert em_model.delay_quantile(le, [98, 1, 0, 1], 0.995) == float("inf")
    assert em_model.delay_quantile(le, [50, 50, 0, 0], 0.5) == 0.001


def test_every_default_parameter_has_a_unit_and_a_source_and_overrides_say_so():
    for name, p in em.PARAMETERS.items():
        assert p.value > 0 and p.unit and len(p.source) > 20, name
    assert 60 <= em.PARAMETERS["boot_s"].value <= 110
    p = em.parameters({"boot_s": 5})
    assert p["boot_s"].value == 5 and p["boot_s"].source.startswith("set for this run")
    with pytest.raises(ValueError, match="unknown timing parameter 'bogus'"):
        em.parameters({"bogus": 1})


def test_dump_params_writes_the_frozen_parameters_with_sources(tmp_path):
    out = tmp_path / "params.json"
    p = subprocess.Popen([sys.executable, em.__file__, "--port", str(free_port()), "--time-scale", "0.01",
                          "--param", "boot_s=2", "--fault", "hang-after=5", "--fault", "never-ready",
                          "--dump-params", str(out), "--no-core-child"], start_new_session=True)
    try:
        doc = wait_until(lambda: out.exists() and out.stat().st_size and json.loads(out.read_text()), 10, "params")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert doc["time_scale"] == 0.01 and doc["parameters"]["boot_s"]["value"] == 2
    assert set(doc["parameters"]) == set(em.PARAMETERS)
    assert all(v["source"] and v["unit"] for v in doc["parameters"].values())
    assert sorted(doc["faults"]) == ["hang-after=5.0", "never-ready"]


async def test_decode_steps_follow_the_batch_and_the_capacity_and_the_time_scale():
    # 4 requests of 10 tokens, capacity 2, step 0.05 s x scale 0.5: two waves of 10 steps.
    e = em.EmulatedEngine(time_scale=0.5, exit_on_death=False, max_num_seqs=2,
                          params={**FAST, "step_base_s": 0.05})
    async with Running(e) as s:
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, len(e.running))
                await asyncio.sleep(0.005)
        w = asyncio.ensure_future(watch())
        t0 = time.monotonic()
        answers = await asyncio.gather(*(s.post("/v1/completions", req("abc", 10)) for _ in range(4)))
        took = time.monotonic() - t0
        w.cancel()
    assert all(code == 200 and a["choices"][0]["finish_reason"] == "length" for code, a in answers)
    assert peak == 2
    assert 0.45 <= took <= 2.0, took  # 20 steps x 0.025 s (the upper bound: a loaded CI machine)
    assert e.generation_tokens == 40


async def test_prefill_is_paid_per_prompt_token_so_a_continuation_pays_its_recompute():
    e = em.EmulatedEngine(time_scale=1.0, exit_on_death=False, params={**FAST, "step_base_s": 0.001,
                                                                     "prefill_token_s": 0.002})
    async with Running(e) as s:
        t0 = time.monotonic()
        await s.post("/v1/completions", req([5] * 10, 1))
        short = time.monotonic() - t0
        t0 = time.monotonic()
        await s.post("/v1/completions", req([5] * 200, 1))
        long = time.monotonic() - t0
    assert long - short >= 0.3, (short, long)  # 190 more prompt tokens x 2 ms
    assert e.prompt_tokens == 210


async def test_the_first_batch_is_slow_and_moves_no_counter_meanwhile():
    e = engine(first_batch_s=1.5)
    async with Running(e) as s:
        first = asyncio.ensure_future(s.post("/v1/completions", req("hi", 1)))
        await until(lambda: e.compiling, 1.0)
        await asyncio.sleep(0.3)
        _, metrics = await s.get("/metrics")
        assert "vllm:generation_tokens_total{engine=\"0\",model_name=\"tiny\"} 0.0" in metrics
        assert e.compiling and not first.done()
        await first
        t0 = time.monotonic()
        await s.post("/v1/completions", req("hi", 1))
        assert time.monotonic() - t0 < 1.0  # the compile is paid once


# -- tokens: deterministic, so a continuation can be checked token-equal ----------------------------


async def test_a_continued_request_is_token_equal_to_the_uninterrupted_one():
    async with Running(engine()) as a, Running(engine()) as b:
        _, whole = await a.post("/v1/completions", req("the quick brown", 12))
        ids = whole["choices"][0]["token_ids"]
        prompt = whole["choices"][0]["prompt_token_ids"]
        assert ids == em.generate(prompt, 12, "default", a.engine.vocab.choices)
        # cut after 5 tokens; continued on another engine at the same weights
        _, rest = await b.post("/v1/completions", req(prompt + ids[:5], 7))
        assert rest["choices"][0]["token_ids"] == ids[5:]
        assert whole["choices"][0]["logprobs"]["token_logprobs"][5:] == rest["choices"][0]["logprobs"]["token_logprobs"]
        # other weights, other tokens
        await b.post("/update_weight_version", {"new_version": "7"})
        _, other = await b.post("/v1/completions", req("the quick brown", 12))
        assert other["choices"][0]["token_ids"] != ids
        # the stream carries the same tokens as the whole answer
        chunks = await a.stream(req("the quick brown", 12))
    streamed = [t for c in chunks if isinstance(c, dict) and c["choices"] for t in c["choices"][0]["token_ids"]]
    assert streamed == ids


async def test_lie_version_reports_a_version_whose_weights_it_does_not_hold():
    honest, liar = engine(), em.EmulatedEngine(exit_on_death=False, params=FAST, faults=["lie-version"])
    async with Running(honest) as h, Running(liar) as lie:
        for s in (h, lie):
            assert (await s.post("/update_weight_version", {"new_version": "3"}))[0] == 200
            assert json.loads((await s.get("/weight_info"))[1]) == {"weight_version": "3"}
        _, a = await h.post("/v1/completions", req("x y", 6))
        _, b = await lie.post("/v1/completions", req("x y", 6))
    assert a["choices"][0]["token_ids"] != b["choices"][0]["token_ids"]
    assert b["choices"][0]["token_ids"] == em.generate(b["choices"][0]["prompt_token_ids"], 6, "default",
                                                       liar.vocab.choices)


# -- pause ------------------------------------------------------------------------------------------


async def test_pause_abort_ends_streams_with_their_tokens_or_with_no_chunk_and_queues_new_ones():
    e = engine(step_base_s=0.02)
    async with Running(e) as s:
        running = asyncio.ensure_future(s.stream(req("go", 200, stream_options={"include_usage": True})))
        await until(lambda: e.generation_tokens >= 3, 5)
        assert (await s.post("/pause", params={"mode": "abort"}))[0] == 200
        chunks = await running
        last = [c for c in chunks if isinstance(c, dict) and c["choices"]][-1]["choices"][0]
        assert last["finish_reason"] == "abort" and last["token_ids"] == [] and last["text"] == ""
        usage = chunks[-2]["usage"]
        assert 3 <= usage["completion_tokens"] < 200 and chunks[-1] == "[DONE]"
        # sent while paused: queued, not answered until /resume
        queued = asyncio.ensure_future(s.stream(req("go", 2)))
        await asyncio.sleep(0.3)
        assert not queued.done()
        assert json.loads((await s.get("/is_paused"))[1]) == {"is_paused": True}
        await s.post("/resume")
        assert [c for c in await queued if isinstance(c, dict)][-1]["choices"][0]["finish_reason"] == "length"
        # cut before its first token: no chunk with a choice, the usage and [DONE] only
        await s.post("/pause", params={"mode": "keep"})
        held = asyncio.ensure_future(s.stream(req("go", 2, stream_options={"include_usage": True})))
        await asyncio.sleep(0.2)
        await s.post("/pause", params={"mode": "abort"})
        chunks = await held
        assert [c["choices"] for c in chunks if isinstance(c, dict)] == [[]] and chunks[-1] == "[DONE]"
        assert (await s.post("/pause", params={"mode": "bogus"}))[0] == 400


async def test_pause_wait_returns_once_in_flight_work_is_done_and_keep_freezes_it():
    e = engine(step_base_s=0.02)
    async with Running(e) as s:
        running = asyncio.ensure_future(s.post("/v1/completions", req("go", 15)))
        await until(lambda: e.generation_tokens >= 1, 5)
        await s.post("/pause", params={"mode": "wait"})
        assert running.done() and running.result()[1]["choices"][0]["finish_reason"] == "length"
        await s.post("/resume")
        running = asyncio.ensure_future(s.post("/v1/completions", req("go", 15)))
        await until(lambda: e.generation_tokens >= 17, 5)
        await s.post("/pause", params={"mode": "keep"})
        frozen = e.generation_tokens
        await asyncio.sleep(0.3)
        assert e.generation_tokens == frozen and not running.done()
        await s.post("/resume")
        code, answer = await running
    assert code == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert len(answer["choices"][0]["token_ids"]) == 15


# -- weights ----------------------------------------------------------------------------------------


async def test_a_push_costs_its_bytes_at_the_bandwidth_and_sets_the_version():
    e = em.EmulatedEngine(exit_on_death=False, time_scale=0.5, params={**FAST, "push_bytes_per_s": 1e9})
    async with Running(e) as s:
        assert (await s.post("/start_weight_update"))[0] == 500  # no group: refused, untouched
        assert e.poisoned is None
        await s.post("/init_weight_transfer_engine", {"init_info": {"master_address": "x", "master_port": 1,
                                                                    "rank_offset": 1, "world_size": 2}})
        assert (await s.post("/start_weight_update"))[0] == 200
        t0 = time.monotonic()
        code, _ = await s.post("/update_weights", {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"],
                                                                   "shapes": [[500_000_000]]}})
        took = time.monotonic() - t0
        assert code == 200 and 0.45 <= took <= 2.0, took  # 1 GB at 1 GB/s x 0.5
        assert (await s.post("/finish_weight_update", {"weight_version": "9"}))[0] == 200
        assert json.loads((await s.get("/weight_info"))[1]) == {"weight_version": "9"}
        assert e.identity == "9"


async def test_a_push_that_fails_midway_poisons_and_the_next_generation_kills_the_engine():
    e = em.EmulatedEngine(exit_on_death=False, params={**FAST, "push_bytes_per_s": 1e9, "model_bytes": 4e8},
                          faults=["push-fail-at=0.5"])
    async with Running(e) as s:
        await s.post("/init_weight_transfer_engine", {"init_info": {}})
        await s.post("/start_weight_update")
        t0 = time.monotonic()
        code, err = await s.post("/update_weights", {"update_info": {}})
        assert code == 500 and "poisoned" in err["error"]["message"]
        assert 0.18 <= time.monotonic() - t0 <= 1.0  # half of 0.4 s
        assert (await s.get("/health"))[0] == 200  # looks healthy
        assert (await s.post("/start_weight_update"))[0] == 500  # refuses a new session
        code, err = await s.post("/v1/completions", req("hi", 1))
        assert code == 500 and err["error"]["message"] == em.ENGINE_DEAD
        assert (await s.get("/health"))[0] == 503


async def test_a_staged_push_that_fails_leaves_the_weights_intact_and_a_sender_that_hangs_up_poisons():
    e = em.EmulatedEngine(exit_on_death=False, params={**FAST, "push_bytes_per_s": 1e9, "model_bytes": 4e8},
                          faults=["push-fail-at=0.2"])
    async with Running(e) as s:
        await s.post("/init_weight_transfer_engine", {"init_info": {}})
        await s.post("/start_weight_update")
        code, err = await s.post("/update_weights", {"update_info": {"staged": True}})
        assert code == 500 and em.NOT_LOADED in err["error"]["message"] and e.poisoned is None
        await s.post("/start_weight_update")
        with pytest.raises(asyncio.TimeoutError):
            await s.post("/update_weights", {"update_info": {}}, timeout=aiohttp.ClientTimeout(total=0.1))
        await until(lambda: e.poisoned is not None, 5, "the half-loaded engine is poisoned")


async def test_a_reload_costs_the_model_bytes_and_a_bad_path_poisons(tmp_path):
    e = em.EmulatedEngine(exit_on_death=False, params={**FAST, "reload_bytes_per_s": 1e9, "model_bytes": 3e8})
    async with Running(e) as s:
        t0 = time.monotonic()
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
        code, got = await s.post("/collective_rpc", rpc)
        assert code == 200 and got == {"results": [None]} and time.monotonic() - t0 >= 0.28
        code, _ = await s.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/nope"}})
        assert code == 500 and (await s.get("/health"))[0] == 200
        assert (await s.post("/v1/completions", req("hi", 1)))[0] == 500


# -- emulated faults --------------------------------------------------------------------------------


async def test_an_engine_core_hang_keeps_health_200_and_stops_generation_and_the_counters():
    e = engine()
    async with Running(e) as s:
        await s.post("/v1/completions", req("hi", 2))
        assert (await s.post("/emulator/fault", {"fault": "hang"}))[0] == 200
        before = e.generation_tokens
        assert (await s.get("/health"))[0] == 200
        for path, post in (("/v1/completions", True), ("/is_paused", False), ("/weight_info", False)):
            with pytest.raises(asyncio.TimeoutError):
                timeout = aiohttp.ClientTimeout(total=0.4)
                await (s.post(path, req("hi", 1), timeout=timeout) if post else s.get(path, timeout=timeout))
        assert e.generation_tokens == before
        await s.post("/emulator/fault", {"fault": "clear"})
        assert (await s.post("/v1/completions", req("hi", 1)))[0] == 200
        assert (await s.post("/emulator/fault", {"fault": "bogus"}))[0] == 400


async def test_a_dead_engine_core_fails_requests_in_flight_and_health_says_503():
    e = engine(step_base_s=0.05)
    async with Running(e) as s:
        streaming = asyncio.ensure_future(s.stream(req("hi", 100)))
        whole = asyncio.ensure_future(s.post("/v1/completions", req("hi", 100)))
        await until(lambda: e.generation_tokens >= 2, 5)
        await s.post("/emulator/fault", {"fault": "die"})
        chunks = await streaming
        assert chunks[-2]["error"]["message"] == em.ENGINE_DEAD and chunks[-1] == "[DONE]"
        code, err = await whole
        assert code == 500 and err["error"]["type"] == "InternalServerError"
        assert (await s.get("/health"))[0] == 503


async def test_timed_faults_and_reject_logprobs():
    e = em.EmulatedEngine(exit_on_death=False, params=FAST, faults=["hang-after=0.3", "reject-logprobs"])
    async with Running(e) as s:
        code, err = await s.post("/v1/completions", req("hi", 1))
        assert code == 400 and err["error"]["param"] == "logprobs"
        assert (await s.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}))[0] == 200
        await until(lambda: e.hung, 3, "hang-after")


# -- real faults and process faults (one emulated engine process each) ------------------------------


def spawn(*args: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, em.__file__, "--port", str(port), "--param", "boot_s=0",
                             "--param", "first_batch_s=0", "--time-scale", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def get(url: str, timeout: float = 2.0) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def complete(url: str, timeout: float) -> int:
    import urllib.request

    r = urllib.request.Request(url + "/v1/completions", data=json.dumps(req("hi", 1)).encode(),
                               headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=timeout) as resp:
        return resp.status


def test_boot_time_crash_at_start_and_a_boot_that_never_ends(tmp_path):
    port = free_port()
    p = subprocess.Popen([sys.executable, em.__file__, "--port", str(port), "--param", "boot_s=2",
                          "--time-scale", "0.5", "--no-core-child"], stdout=subprocess.PIPE, start_new_session=True)
    never = spawn("--fault", "never-ready", port=free_port())
    crash = spawn("--fault", "crash-at-start", port=free_port())
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError):  # the port is not bound while it boots (vLLM: refused)
            get(f"http://127.0.0.1:{port}/health", 0.5)
        assert p.stdout is not None and b"ready" in p.stdout.readline()
        assert 0.9 <= time.monotonic() - t0 <= 6.0  # boot_s 2 x 0.5, plus a loaded machine's start-up
        assert get(f"http://127.0.0.1:{port}/health") == 200
        assert crash.wait(10) == 1
        assert crash.stderr is not None and b"crashed at start" in crash.stderr.read()
        time.sleep(1.0)
        assert never.poll() is None
    finally:
        for q in (p, never, crash):
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
            q.wait()


def test_a_fault_file_arms_this_start_only_and_is_consumed(tmp_path):
    armed = tmp_path / "e0.faults"
    armed.write_text("crash-at-start\n")
    first = spawn("--fault-file", str(armed), "--no-core-child", port=free_port())
    try:
        assert first.wait(10) == 1  # this start crashed
        assert not armed.exists()   # and the file is gone: the next start boots
        port = free_port()
        second = spawn("--fault-file", str(armed), "--no-core-child", port=port)
        try:
            assert second.stdout is not None and b"ready" in second.stdout.readline()
            assert get(f"http://127.0.0.1:{port}/health") == 200
        finally:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()


async def test_slow_batch_at_compiles_the_first_batch_of_that_size_once():
    e = em.EmulatedEngine(time_scale=1.0, exit_on_death=False, faults=["slow-batch-at=2"],
                          params={**FAST, "first_batch_s": 1.5})
    async with Running(e) as s:
        assert (await s.post("/v1/completions", req("abc", 3)))[0] == 200  # the engine's first batch
        t0 = time.monotonic()
        assert (await s.post("/v1/completions", req("abc", 3)))[0] == 200  # one running: no compile
        one = time.monotonic() - t0
        t0 = time.monotonic()
        assert all(c == 200 for c, _ in await asyncio.gather(*(s.post("/v1/completions", req("ab", 3))
                                                               for _ in range(2))))
        two = time.monotonic() - t0
        t0 = time.monotonic()
        await asyncio.gather(*(s.post("/v1/completions", req("ab", 3)) for _ in range(2)))
        again = time.monotonic() - t0
    assert one < 1.0 and two >= 1.5 and again < 1.0, (one, two, again)  # bounds a loaded host keeps


async def test_the_state_route_serves_how_late_the_step_loop_woke():
    e = em.EmulatedEngine(time_scale=1.0, exit_on_death=False, params={**FAST, "step_base_s": 0.005})
    async with Running(e) as s:
        code, _ = await s.post("/v1/completions", req("abc", 20))
        assert code == 200
        _, text = await s.get("/emulator/state")
    d = json.loads(text)["sched_delay"]
    assert d["le"] == list(em_model.DELAY_BUCKETS) and len(d["counts"]) == len(d["le"]) + 1
    # A reading per sleep of the step loop (a late wake-up's surplus runs the next steps unslept)
    assert sum(d["counts"]) >= 1 and d["max_s"] >= 0
    before = list(e.delay_counts)
    e._late(0.0015)
    e._late(7.0)
    assert e.delay_counts[1] == before[1] + 1 and e.delay_counts[-1] == before[-1] + 1 and e.delay_max == 7.0


def test_sigstop_of_the_engine_core_child_hangs_generation_while_health_says_200_and_its_death_ends_the_server():
    port = free_port()
    p = spawn("--param", "step_base_s=0.001", "--param", "death_exit_s=0.5", port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        assert p.stdout is not None
        ready = json.loads(p.stdout.readline())
        core = ready["core"]
        with open(f"/proc/{core}/comm") as f:
            assert f.read().strip().startswith("VLLM::EngineCor")
        assert complete(url, 5) == 200
        os.kill(core, signal.SIGSTOP)
        time.sleep(0.3)
        assert get(url + "/health") == 200
        with pytest.raises(OSError):  # timeout
            complete(url, 1.0)
        os.kill(core, signal.SIGCONT)
        assert complete(url, 5) == 200
        os.kill(core, signal.SIGKILL)
        wait_until(lambda: p.poll() is not None, 10, "the server exits after its engine core died")
        assert p.returncode == 1
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_kill_9_of_the_server_takes_its_core_child_with_it():
    port = free_port()
    p = spawn(port=port)
    try:
        assert p.stdout is not None
        core = json.loads(p.stdout.readline())["core"]
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        wait_until(lambda: not os.path.exists(f"/proc/{core}") or open(f"/proc/{core}/stat").read().split()[2] == "Z",
                   5, "the orphaned core child leaves")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- the comparison itself can fail ---------------------------------------------------------------


def test_drift_names_a_dropped_key_a_changed_status_and_an_extra_metric():
    choice = {"text": "str", "token_ids": ["list", "number"]}
    real = {"completion": {"status": 200, "body": {"choices": ["list", choice]}},
            "stream": [["status", 200], {"choices": ["list"]}, "[DONE]"],
            "metric_names": ["vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_running",
                             "vllm:num_requests_waiting"], "metric_types": {"vllm:generation_tokens_total": "counter"}}
    assert drift(real, real) == []
    mutated = json.loads(json.dumps(real))
    del mutated["completion"]["body"]["choices"][1]["token_ids"]
    mutated["stream"] = [["status", 200], "[DONE]"]
    mutated["metric_names"].append("vllm:made_up")
    mutated["metric_types"]["vllm:generation_tokens_total"] = "gauge"
    found = "\n".join(drift(real, mutated))
    assert "completion.body.choices[1].token_ids: sent by vLLM, not by the emulator" in found
    assert "stream:" in found and "vllm:made_up" in found and "emulator says gauge" in found


def test_a_chunk_vllm_merged_has_the_shape_of_the_chunks_it_merged():
    head = {"id": "c", "object": "text_completion", "created": 1, "model": "tiny"}

    def chunk(ids, first, end, lp=True):
        c = {"index": 0, "text": "x" * len(ids), "finish_reason": end, "stop_reason": None,
             "prompt_token_ids": [1, 2] if first else None, "token_ids": ids,
             "logprobs": {"text_offset": [0] * len(ids), "token_logprobs": [-1.0] * len(ids),
                          "tokens": ["x"] * len(ids), "top_logprobs": [{"x": -1.0}] * len(ids)} if lp else None}
        return {**head, "choices": [c]}
    separate = [chunk([5], True, None), chunk([6], False, None), chunk([7], False, "length")]
    merged = [chunk([5, 6, 7], True, "length")]
    as_sent = [shape(c) for c in separate]
    assert collapse([shape(p) for c in merged for p in unmerge(c)]) == collapse(as_sent)
    assert collapse([shape(c) for c in merged]) != collapse(as_sent)  # what unmerge is for


async def test_a_fault_that_names_another_pid_is_refused_and_strikes_nothing():
    e = em.EmulatedEngine(exit_on_death=False, params=FAST)
    async with Running(e) as s:   # served in this process: its pid is ours
        code, err = await s.post("/emulator/fault", {"fault": "poison", "pid": os.getpid() + 1})
        assert code == 409 and "not for it" in err["error"]["message"]
        assert e.poisoned is None
        for bad in (str(os.getpid()), True, 1.5, [os.getpid()], 0):
            code, err = await s.post("/emulator/fault", {"fault": "poison", "pid": bad})
            assert code == 400 and "must be a process id" in err["error"]["message"], bad
        assert e.poisoned is None
        code, _ = await s.post("/emulator/fault", {"fault": "poison", "pid": os.getpid()})
        assert code == 200 and e.poisoned is not None


def test_free_port_ranges_of_runs_side_by_side_start_apart():
    bases = {em.free_port_range(8) for _ in range(5)}
    assert len(bases) > 1          # a fixed first place gave every run the same ports
    assert all(20000 <= b and b + 8 <= em._ephemeral_low() for b in bases)  # below outgoing connections' ports
    assert em.free_port_range(1, start=29000) >= 29000


def test_free_port_range_still_finds_ports_where_outgoing_connections_start_low(monkeypatch):
    monkeypatch.setattr(em, "_ephemeral_low", lambda: 1024)   # ip_local_port_range = 1024 65535
    assert 20000 <= em.free_port_range(8) <= 60000 - 8
