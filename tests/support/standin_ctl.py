"""A PROTOCOL STAND-IN for a vLLM OpenAI server (tests only), for supervisorctl's habits
(tests/daemon/test_ctl_habits.py): /health, /v1/completions, /weight_info; GET /say?text=X
prints X to its log; SIGHUP prints "SIGHUP received"; it writes nothing unasked after its
first line. The mode in $STANDIN_MODE_FILE, read at start: "fail" exits 1 at once, "slow"
takes 3 s to start."""

import os
import signal
import sys
import time

from aiohttp import web

from standin_cli import engine_args

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


async def health(request):
    return web.Response()


async def say(request):
    print(request.query["text"], flush=True)
    return web.Response()


async def completions(request):
    return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}]})


async def weight_info(request):
    return web.json_response({"weight_version": "default"})


app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/say", say)
app.router.add_post("/v1/completions", completions)
app.router.add_get("/weight_info", weight_info)
web.run_app(app, host=args.host, port=args.port, print=None)
