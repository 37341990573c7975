"""One engine: its runner (runner.py), state machine (fsm.py), process, probes, warm-up and
post-mortems. The fleet and the service sit above it and hand it what it asks of them."""
