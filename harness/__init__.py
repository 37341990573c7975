"""The harness: the demo, the chaos loop (the example loop with faults at its hook points) and
the soak, fault injectors, a local daemon and engine stand-ins.

Nothing in supervisor/, trainer/ or weight_sync/ imports it."""
