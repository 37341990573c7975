"""What the tests share and nothing ships: polling, HTTP requests, daemon and real-engine setup
and teardown, and the PROTOCOL STAND-INS for vLLM engines. The daemon harness the demo and the
soak use too (vime.harness.local_daemon) stays in the package; this builds on it.

pytest puts tests/ on sys.path (pyproject: [tool.pytest.ini_options] pythonpath), so a test
imports `from support.polling import wait_until`."""
