"""A model-free receiver speaking vLLM's weight-transfer HTTP routes, for benchmarks and tests.

It runs the real `vime.weight_sync.gloo_engine.GlooWeightTransferEngine` (the same group join,
wire parsing and `receive_update` loop as inside a vLLM worker) behind a small stdlib HTTP
server with no model: it measures the sender, the transport and the receive path, not vLLM's
weight loading. Several are the fleet broadcast's stand-in receivers (docs/benchmarks.md);
`GET /stand_in` tells what one received. Needs vLLM importable.

    python -m vime.harness.loopback --port 8123 [--keep] [--host ADDR]   # prints "READY <port>"
"""

from __future__ import annotations

import argparse
import json
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import torch


def make_engine(load_weights):
    from vime.weight_sync.gloo_engine import GlooWeightTransferEngine

    class ModelFreeGlooEngine(GlooWeightTransferEngine):
        # No vLLM model to move to meta and back: count instead, so a test can tell whether a
        # failed staged update touched "the model" (reloads_begun) or not.
        reloads_begun = 0
        reloads_ended = 0

        def _begin_reload(self) -> None:
            self.reloads_begun += 1

        def _end_reload(self) -> None:
            self.reloads_ended += 1

    model = SimpleNamespace(load_weights=load_weights)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        model_config=None)
    return ModelFreeGlooEngine(SimpleNamespace(backend="gloo"), vllm_config, "cpu", model)


class LoopbackEngine:
    """The HTTP server in a background thread. keep=True keeps every received (name, tensor)."""

    def __init__(self, port: int = 0, keep: bool = False, host: str = "127.0.0.1"):
        self.received: list = []
        self.version = "default"
        self.paused = False
        self.calls: list[str] = []
        self._received_lock = threading.Lock()
        self._lock = threading.Lock()  # one engine call at a time, like vLLM's collective_rpc

        def load(pairs):
            if keep:  # the last version only: one entry per name
                with self._received_lock:
                    names = {n for n, _ in pairs}
                    self.received[:] = [(n, t) for n, t in self.received if n not in names] + list(pairs)

        self.engine = make_engine(load)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _reply(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                u = urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                outer.calls.append(u.path)
                try:
                    self._reply(200, outer.dispatch(method, u.path, parse_qs(u.query), body))
                except KeyError:
                    self._reply(404, {"error": {"message": f"no route {u.path}"}})
                except Exception as e:  # noqa: BLE001 - like vLLM: a worker error becomes a 500
                    traceback.print_exc()
                    self._reply(500, {"error": {"message": f"Worker failed with error '{e}'"}})

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _set_paused(self, paused: bool) -> dict:
        self.paused = paused
        return {"status": "paused" if paused else "resumed"}

    def dispatch(self, method: str, path: str, query: dict, body: dict):
        e = self.engine
        routes = {
            ("GET", "/health"): lambda: None,
            ("GET", "/get_world_size"): lambda: {"world_size": 1},
            ("GET", "/weight_info"): lambda: {"weight_version": self.version},
            ("GET", "/is_paused"): lambda: {"is_paused": self.paused},
            ("GET", "/stand_in"): self.stand_in_state,
            ("POST", "/pause"): lambda: self._set_paused(True),
            ("POST", "/resume"): lambda: self._set_paused(False),
            ("POST", "/init_weight_transfer_engine"):
                lambda: e.init_transfer_engine(e.parse_init_info(body["init_info"])),
            ("POST", "/shutdown_weight_transfer_engine"): e.shutdown,
            ("POST", "/start_weight_update"): e.start_weight_update,
            ("POST", "/update_weights"): lambda: e.update_weights(body["update_info"]),
            ("POST", "/finish_weight_update"): lambda: self._finish(body.get("weight_version")),
        }
        fn = routes[(method, path)]
        if path in ("/stand_in", "/health"):  # probes answer beside a transfer, as vLLM's /health
            return fn()
        with self._lock:
            out = fn()
        return out if out is not None else {"message": "ok"}

    def stand_in_state(self) -> dict:
        import hashlib

        e = self.engine
        return {"version": self.version, "paused": self.paused, "poisoned": e.poisoned,
                "reloads_begun": e.reloads_begun, "reloads_ended": e.reloads_ended,
                "received": {n: hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy()
                                             .tobytes()).hexdigest() if t.numel() else ""
                             for n, t in self.received}}

    def _finish(self, version):
        self.engine.finish_weight_update()
        if version is not None:
            self.version = version

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.engine.shutdown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    ap.add_argument("--keep", action="store_true", help="keep what is received (GET /stand_in digests it)")
    args = ap.parse_args(argv)
    eng = LoopbackEngine(args.port, keep=args.keep, host=args.host)
    print(f"READY {eng.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        eng.close()


if __name__ == "__main__":
    main()
