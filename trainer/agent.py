"""Old name of trainer/resync_agent.py, kept only for tests/daemon/test_restart_faults.py and
tests/engine/test_resync_real.py; delete it once they import ResyncAgent from there."""

from vime.trainer.resync_agent import ResyncAgent, ResyncRecord, WeightsProvider

SyncAgent = ResyncAgent

__all__ = ["ResyncAgent", "ResyncRecord", "SyncAgent", "WeightsProvider"]
