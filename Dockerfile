# vime-supervisor on a GPU host: the daemon beside vLLM engines it spawns.
#   docker build -t vime-supervisor .
#   docker run --gpus all -v /run/vime-supervisor:/run/vime-supervisor \
#       -v /etc/vime-supervisor:/etc/vime-supervisor:ro -v /models:/models:ro vime-supervisor
FROM vllm/vllm-openai:v0.33.0

WORKDIR /opt/vime
COPY pyproject.toml README.md ./
COPY supervisor ./supervisor
COPY trainer ./trainer
COPY weight_sync ./weight_sync
# vLLM pulls in a PyPI package named "supervisor" (supervisord) whose top-level package is
# the same directory as ours: remove it first (nothing imports it), then install ours.
RUN (pip uninstall -y supervisor || true) && pip install --no-cache-dir .

VOLUME ["/run/vime-supervisor"]
ENTRYPOINT ["vime-supervisor", "--config", "/etc/vime-supervisor/config.toml"]
