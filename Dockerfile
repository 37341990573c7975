# vime-supervisor on a GPU host: the daemon beside vLLM engines it spawns.
#   docker build -t vime-supervisor .
#   docker run --gpus all -v /run/vime-supervisor:/run/vime-supervisor \
#       -v /etc/vime-supervisor:/etc/vime-supervisor:ro -v /models:/models:ro vime-supervisor
FROM vllm/vllm-openai:v0.33.0

WORKDIR /opt/vime
# The wheel is built from exactly these files (tests/unit/test_docker_wheel.py builds it from
# them). src/vime/ holds relative symlinks to the card's folders: COPY keeps them as links.
COPY pyproject.toml README.md ./
COPY src ./src
COPY supervisor ./supervisor
COPY trainer ./trainer
COPY weight_sync ./weight_sync
COPY harness ./harness
COPY cluster ./cluster
COPY deploy ./deploy
# Ours imports as vime.*, beside supervisord (which vLLM pulls in). Both wheels write
# bin/supervisorctl and pip leaves it to the last installed: the --no-deps --force-reinstall
# makes it ours, a dispatcher that hands supervisord's invocations to supervisord's
# (docs/supervisorctl.md); vime-supervisorctl is always ours. pip check must
# find nothing wrong with supervisord or us (the base image's own packages are its business).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps --force-reinstall . \
    && grep -q "vime.supervisor.supervisorctl" "$(command -v supervisorctl)" \
    && supervisorctl --help | grep -q "vime-supervisor daemon" \
    && { pip check > /tmp/pip-check.txt || true; } \
    && cat /tmp/pip-check.txt \
    && ! grep -iE "^(supervisor|vime-supervisor) |requires (supervisor|vime-supervisor)," /tmp/pip-check.txt

VOLUME ["/run/vime-supervisor"]
ENTRYPOINT ["vime-supervisor", "--config", "/etc/vime-supervisor/config.toml"]
