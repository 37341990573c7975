"""The harness: the demo, the chaos soak, fault injectors, a local daemon and engine stand-ins.

Nothing in supervisor/, trainer/ or weight_sync/ imports it."""
