"""A model-free receiver speaking vLLM's weight-transfer HTTP routes, for benchmarks and tests.

It runs the real `vime.weight_sync.gloo_engine.GlooWeightTransferEngine` (the same group join, the
same wire parsing, the same `receive_update` loop as inside a vLLM worker) behind a tiny
stdlib HTTP server, but with NO vLLM model: ``load_weights`` either discards the tensors or
keeps them for inspection, and ``/start_weight_update`` / ``/finish_weight_update`` skip vLLM's
layerwise reload (there is no model to move to meta and back). What it measures is therefore
the sender + transport + receive-and-unpack path, not vLLM's weight loading.

    python -m vime.harness.loopback --port 8123       # prints "READY <port>" when listening

Needs vLLM importable (for the engine's base class and its stateless group init).
"""

from __future__ import annotations

import argparse
import json
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit


def make_engine(load_weights):
    from vime.weight_sync.gloo_engine import GlooWeightTransferEngine

    class ModelFreeGlooEngine(GlooWeightTransferEngine):
        def start_weight_update(self) -> None:
            self._check_ready()
            self._in_session = True

        def finish_weight_update(self) -> None:
            if self.poisoned is not None:
                raise RuntimeError(f"poisoned: {self.poisoned}")
            self._in_session = False

    model = SimpleNamespace(load_weights=load_weights)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        model_config=None)
    return ModelFreeGlooEngine(SimpleNamespace(backend="gloo"), vllm_config, "cpu", model)


class LoopbackEngine:
    """The HTTP server in a background thread. keep=True keeps every received (name, tensor)."""

    def __init__(self, port: int = 0, keep: bool = False):
        self.received: list = []
        self.version = "default"
        self.paused = False
        self.calls: list[str] = []
        self._lock = threading.Lock()  # one engine call at a time, like vLLM's collective_rpc

        def load(pairs):
            if keep:
                self.received.extend(pairs)

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

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
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
        with self._lock:
            out = fn()
        return out if out is not None else {"message": "ok"}

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
    args = ap.parse_args(argv)
    eng = LoopbackEngine(args.port)
    print(f"READY {eng.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        eng.close()


if __name__ == "__main__":
    main()
