"""A PROTOCOL STAND-IN for a vLLM OpenAI server (tests only), for supervisorctl's habits
(tests/daemon/test_ctl_habits.py): the emulated engine's routes (harness/emulated_engine.py,
protocol-only) plus GET /say?text=X, which prints X to its log; SIGHUP prints "SIGHUP
received"; it writes nothing unasked after its first line. The mode in $STANDIN_MODE_FILE,
read at start: "fail" exits 1 at once, "slow" takes 3 s to start."""

import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from standin_cli import engine_args

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "harness"))
from emulated_engine import make_app  # noqa: E402

args = engine_args()
try:
    with open(os.environ["STANDIN_MODE_FILE"]) as f:
        mode = f.read().strip()
except (KeyError, OSError):
    mode = "ok"
if mode == "fail":
    print("boom: failing on purpose", flush=True)
    sys.exit(1)
if mode == "slow":
    time.sleep(3)
print(f"stand-in pid {os.getpid()} on port {args.port} " + "." * 300, flush=True)
signal.signal(signal.SIGHUP, lambda *_: print("SIGHUP received", flush=True))


async def say(request):
    print(request.query["text"], flush=True)
    return web.Response()


app = make_app()
app.router.add_get("/say", say)
web.run_app(app, host=args.host, port=args.port, print=None)
