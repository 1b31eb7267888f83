"""torpor on Ray: a rollout fleet of engine replicas for RL post-training beyond one machine.

- `EngineActor`: a Ray actor holding one engine (an `LLM`; its tensor-parallel ranks inside it).
- `RolloutFleet`: replicas on their placement-group bundles, routing with group affinity, fleet-wide sleep / wake /
  weight updates, failure detection, re-sent requests and restarts at the fleet's weight version.
- `GroupBroadcaster`: the trainer's rank 0 of one weights update group across every replica's ranks.
- `torpor.ray.openrlhf`: OpenRLHF's `create_vllm_engines` and rollout-actor surface; `torpor.ray.verl`: a verl
  rollout (`torpor` in verl's replica registry).

Importing `torpor` never imports Ray; importing `torpor.ray` does (`pip install torpor[ray]`). See docs/ray.md.
"""

from torpor.ray.actor import EngineActor
from torpor.ray.calls import FleetError, FleetResults, FleetTimeoutError
from torpor.ray.fleet import RolloutFleet, WeightSource
from torpor.ray.weights import GroupBroadcaster, spec

__all__ = ["EngineActor", "FleetError", "FleetResults", "FleetTimeoutError", "GroupBroadcaster", "RolloutFleet",
           "WeightSource", "spec"]
