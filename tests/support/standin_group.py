"""A PROTOCOL STAND-IN for a vLLM server's process group, for faults vLLM cannot be made to show
on demand (tests only; every behaviour here is also tested against real engines): the emulated
engine (harness/emulated_engine.py) in protocol-only mode (time scale 0: it answers at once).

Run by the daemon in place of the engine's interpreter (config `python = <this file>`), it
takes the spawn command line (`-m vllm.entrypoints.openai.api_server --model M --port P`),
serves vLLM's routes, and forks a child titled like vLLM's EngineCore in its process group
(its pid written to $STANDIN_MODE_FILE.core.<server pid>). The mode file (env
STANDIN_MODE_FILE, re-read at every request) says how it acts:

    ok          answer everything at once
    busy        completions wait while the core burns CPU (a compile: no counter moves)
    hang        completions wait, the core idles (the test SIGSTOPs it: a hung EngineCore)
    paused      completions wait, /is_paused says true (vLLM 0.32 queues while paused)
    silent      /health never answers (a start that cannot finish inside first_wait)
    deaf        as ok, and SIGTERM is ignored by the whole group (a stop that outlives it)
    reject      completions with logprobs answer 400 (a warm-up the engine refuses)
    version=X   as ok, /weight_info answers weight_version X (an engine's untrusted answer)
    weights_down  as ok, /weight_info answers 503 (a route that cannot be read now)

With STANDIN_CONNECTION_CLOSE=1 every answer closes its connection (each probe opens a new one:
what a daemon out of descriptors cannot do).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "harness"))
from emulated_engine import main  # noqa: E402

if __name__ == "__main__":
    main(["--time-scale", "0", *sys.argv[1:]])
