"""A PROTOCOL STAND-IN for a vLLM OpenAI server (tests only), for the client tests
(tests/daemon/test_client_ctl.py): the emulated engine (harness/emulated_engine.py) in
protocol-only mode, each completion request logged and numbered, /weight_info answering the
version written in $STANDIN_VERSION_FILE ("default" without one), as a trainer's weight push
would have set it."""

import os
import sys
from pathlib import Path

from standin_cli import engine_args

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "harness"))
from emulated_engine import main  # noqa: E402

if __name__ == "__main__":
    args = engine_args()
    print(f"stand-in engine pid {os.getpid()} serving {args.host}:{args.port}", flush=True)
    main(["--time-scale", "0", "--no-core-child", "--log-requests",
          "--version-file", os.environ["STANDIN_VERSION_FILE"], *sys.argv[1:]])
