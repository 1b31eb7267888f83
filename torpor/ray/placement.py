"""Where each replica of a fleet runs: its placement-group bundle(s), its share of their GPUs.

A fleet either makes its own placement groups (one per replica, `STRICT_PACK`, one bundle holding the replica's
`tensor_parallel_size` GPUs, so Ray gives the actor all of them and the engine's ranks sit on one node), or is
given the caller's group (how a trainer colocates the engines with its own workers): then `bundle_indices`
names each replica's bundle (an int) or bundles (a list of `tensor_parallel_size` ints, one GPU each, the layout
OpenRLHF and verl use), and `gpu_fraction` is the share of each bundle's GPU the engine takes (e.g. 0.5 next to a
trainer worker on the same GPU).

A replica spanning several bundles runs as one actor on the first; the physical ids of every bundle's GPU are
found by a short task on each bundle and handed to the actor, which then sees exactly those GPUs (Ray leaves the
actor's CUDA_VISIBLE_DEVICES alone for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass
class Slot:
    """One replica's place: bundle(s) of a placement group and the resources its actor takes."""

    group: PlacementGroup
    bundles: list[int]
    num_gpus: float           # the actor's GPUs on its first bundle (0 on CPU)
    num_cpus: float
    owned: bool = False       # made by the fleet (removed with it)
    visible_devices: list[int] | None = field(default=None)  # several bundles: every bundle's GPU id

    def actor_options(self) -> dict:
        options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(
                       placement_group=self.group, placement_group_bundle_index=self.bundles[0],
                       placement_group_capture_child_tasks=True)}
        if self.visible_devices is not None:  # the actor sets CUDA_VISIBLE_DEVICES itself (every bundle's GPU)
            options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        return options


def own_slots(num_replicas: int, tp: int, use_gpu: bool, num_cpus: float, timeout_s: float) -> list[Slot]:
    """A placement group per replica (`STRICT_PACK`), each ready within `timeout_s` or TimeoutError naming it."""
    bundle = {"CPU": num_cpus, **({"GPU": tp} if use_gpu else {})}
    slots = []
    try:
        for i in range(num_replicas):
            group = placement_group([bundle], strategy="STRICT_PACK", name=f"torpor-replica-{i}")
            slots.append(Slot(group, [0], tp if use_gpu else 0, num_cpus, owned=True))
        pending = {s.group.ready(): i for i, s in enumerate(slots)}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
        missing = sorted(pending[r] for r in set(pending) - set(ready))
        if missing:
            raise TimeoutError(f"placement group(s) for replica(s) {missing} ({bundle} each) not ready within "
                               f"{timeout_s:g} s: the cluster lacks the resources ({ray.available_resources()})")
    except BaseException:
        release(slots)
        raise
    return slots


def caller_slots(group: PlacementGroup, bundle_indices, num_replicas: int, tp: int, use_gpu: bool,
                 gpu_fraction: float | None, num_cpus: float, timeout_s: float) -> list[Slot]:
    """Slots in the caller's placement group. `bundle_indices`: None (replica i on bundle i, or on bundles
    i·tp .. i·tp+tp-1 when tp > 1), or one entry per replica: an int (a bundle holding the whole replica) or a
    list of tp ints (one GPU each)."""
    specs = group.bundle_specs
    if bundle_indices is None:
        bundle_indices = [i if tp == 1 else list(range(i * tp, (i + 1) * tp)) for i in range(num_replicas)]
    if not isinstance(bundle_indices, list | tuple) or len(bundle_indices) != num_replicas:
        raise ValueError(f"bundle_indices must hold one entry per replica ({num_replicas}), got {bundle_indices!r}")
    slots = []
    for i, entry in enumerate(bundle_indices):
        bundles = [entry] if isinstance(entry, int) else list(entry)
        if not bundles or not all(isinstance(b, int) and 0 <= b < len(specs) for b in bundles):
            raise ValueError(f"bundle_indices[{i}] must be a bundle index or a list of them, in [0, {len(specs)}), "
                             f"got {entry!r}")
        if len(bundles) not in (1, tp):
            raise ValueError(f"bundle_indices[{i}]: a replica of tensor_parallel_size {tp} takes one bundle or {tp}, "
                             f"got {len(bundles)}")
        share = _gpu_share(i, [specs[b].get("GPU", 0) for b in bundles], bundles, tp, gpu_fraction) if use_gpu else 0
        slots.append(Slot(group, bundles, share, num_cpus))
    if use_gpu:
        _find_devices([s for s in slots if len(s.bundles) > 1], timeout_s)
    return slots


def _gpu_share(replica: int, gpus: list[float], bundles: list[int], tp: int, fraction: float | None) -> float:
    """The GPUs the replica's actor takes on its first bundle (per bundle, when it spans several)."""
    if len(bundles) == 1 and tp > 1:  # the whole replica in one bundle: whole GPUs
        if gpus[0] < tp or fraction not in (None, tp):
            raise ValueError(f"replica {replica}: bundle {bundles[0]} must give the replica its {tp} whole GPUs "
                             f"(the bundle has {gpus[0]:g}, gpu_fraction {fraction!r})")
        return tp
    share = fraction if fraction is not None else (gpus[0] if len(bundles) == 1 else 1.0)
    if not isinstance(share, int | float) or not 0 < share <= min(gpus) or (len(bundles) > 1 and share > 1):
        raise ValueError(f"replica {replica}: gpu_fraction {share!r} must lie in (0, {min(gpus):g}] (the GPUs of "
                         f"bundle(s) {bundles}{', one per bundle' if len(bundles) > 1 else ''})")
    return share


@ray.remote(num_cpus=0)
def _gpu_of_bundle() -> tuple[str, list]:
    return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()


def _find_devices(slots: list[Slot], timeout_s: float) -> None:
    """Each multi-bundle slot's GPU ids, one short task per bundle; all of a replica's bundles on one node."""
    for slot in slots:
        refs = [_gpu_of_bundle.options(num_gpus=slot.num_gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=slot.group, placement_group_bundle_index=b)).remote() for b in slot.bundles]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            raise TimeoutError(f"bundles {slot.bundles}: no answer about their GPUs within {timeout_s:g} s")
        found = ray.get(refs)
        if len({node for node, _ in found}) > 1:
            raise ValueError(f"bundles {slot.bundles} lie on several nodes: one replica's ranks must share a node")
        slot.visible_devices = [int(ids[0]) for _, ids in found]


def release(slots: list[Slot]) -> None:
    """Remove the placement groups the fleet made (the caller's stay)."""
    for slot in slots:
        if slot.owned:
            remove_placement_group(slot.group)
