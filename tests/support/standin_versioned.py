"""A PROTOCOL STAND-IN for a vLLM OpenAI server (tests only), for the client tests
(tests/daemon/test_client_ctl.py): /health, /v1/completions (each one logged, numbered) and
/weight_info, which answers the version written in $STANDIN_VERSION_FILE ("default" without
one), as a trainer's weight push would have set it."""

import os

from aiohttp import web

from standin_cli import engine_args

args = engine_args()
version_file = os.environ["STANDIN_VERSION_FILE"]
served = 0


def version():
    try:
        with open(version_file) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


async def health(request):
    return web.Response()


async def completions(request):
    global served
    served += 1
    print(f"completion request #{served}", flush=True)
    return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}]})


async def weight_info(request):
    return web.json_response({"weight_version": version()})


app = web.Application()
app.router.add_get("/health", health)
app.router.add_post("/v1/completions", completions)
app.router.add_get("/weight_info", weight_info)
print(f"stand-in engine pid {os.getpid()} serving {args.host}:{args.port}", flush=True)
web.run_app(app, host=args.host, port=args.port, print=None)
