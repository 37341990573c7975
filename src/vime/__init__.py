"""vime-supervisor: a fault-tolerance sidecar for vLLM rollout engines in RL post-training.

The design card's folders live at the repository's top level (supervisor/, trainer/,
weight_sync/, harness/, cluster/); src/vime/ holds relative symlinks to them, so the import
path `vime.*` exists on disk and every static tool (mypy, pyright, an editor) can follow it.
"""
