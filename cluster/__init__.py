"""Many nodes: one vime-supervisor daemon per node, one fleet for the trainer, through Ray.

    import ray
    from vime.cluster import ClusterClient
    ray.init(address="auto")
    sup = ClusterClient()            # agents on every Ray node with the vime_supervisor resource
    with sup.round(7):
        engines = sup.routable_engines()["engines"]     # named node/engine
    sup.publish_weights(8, "/ckpt/step-8")

Ray is an optional extra (pip install vime-supervisor[cluster]); the daemon never imports this
package. view.py holds the decisions (pure), agent.py the per-node relay (a Ray actor),
client.py the asyncio client, blocking.py its blocking facade.
"""

from .blocking import ClusterClient
from .client import NODE_RESOURCE, AsyncClusterClient, ClusterBelowFloor, NodeUnavailable
from .view import ClusterEvent, ClusterPush, ClusterView, NodeState, qualify, split

__all__ = ["ClusterClient", "AsyncClusterClient", "NodeUnavailable", "ClusterBelowFloor", "NODE_RESOURCE",
           "ClusterEvent", "ClusterPush", "ClusterView", "NodeState", "qualify", "split"]
