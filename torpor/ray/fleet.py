"""`RolloutFleet`: many torpor engines on a Ray cluster, driven as one by a trainer.

Requests go to the replica with the least outstanding work (sequences routed and not answered), with group
affinity: the `n` samples of one prompt are one request (they stay together on one replica), and prompts that
share a `group_ids` entry go to one replica, also across calls (the fleet remembers the last 65,536 groups), so
its prefix cache serves their shared prefix.

Fleet-wide control calls run on every replica at once and return a `FleetResults` (one entry per replica);
a call that fails anywhere raises `FleetError` naming every replica's error, and every call has a timeout
(`FleetTimeoutError` names the replicas that did not answer).

Failures: a replica whose actor dies is seen within about a second (its calls fail, and a health monitor pings
every replica); its unanswered requests are sent again to the others and answered; it is restarted (up to
`max_restarts` times) on the same placement-group bundle(s) and takes requests again only once it holds the
fleet's current weights: the checkpoint (no update yet, or `reload_weights(path)`), or the tensors of the last
update when the caller handed them to the fleet as `source=` (kept in Ray's object store); otherwise it stays
"stale" until the next update reaches it. A control call waits (within its timeout) for replicas that are
restarting, then includes them; one it still cannot reach is listed in the results' `excluded`.

Pause, abort and the weights' label are vLLM's calls, run by every replica's engine (`LLM.pause_generation`,
`abort_requests`, `update_weight_version`): a paused fleet's replicas hold the requests sent meanwhile until
`resume_generation`; aborted requests come back from `generate` as they are (finish_reason "abort"), not sent
again; a replica restarted during a pause starts paused; the label (`weight_version`, a str on the engine's
tokens) moves with every update.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from torpor.ray.actor import EngineActor
from torpor.ray.calls import (
    FleetError,
    FleetResults,
    FleetTimeoutError,
    ReplicaTimeout,
    describe,
    gather,
    is_dead,
    unwrap,
)
from torpor.ray.placement import Slot, caller_slots, own_slots, release
from torpor.ray.replica import LIVE, HealthMonitor, Replica
from torpor.ray.routing import Unit, prompt_list, units_of

AFFINITY_ENTRIES = 65536


@dataclass
class WeightSource:
    """Where the fleet's current weights can be had again (for a restarted replica): a checkpoint
    (`checkpoint`, at `path`; None: the fleet's model), or the tensors of the last update (`tensors`: an ObjectRef
    of named tensors, or the pairs themselves), or nothing (not kept: a restarted replica waits for the next
    update)."""

    checkpoint: bool = False
    path: str | None = None
    tensors: object = None

    @property
    def kept(self) -> bool:
        return self.checkpoint or self.tensors is not None


class RolloutFleet:
    """`num_replicas` engines of `model` (a checkpoint folder or Hub id readable on every node; None: the
    embedded tiny model), each `tensor_parallel_size` ranks, on GPU ("cuda"), CPU ("cpu") or "auto" (GPU when the
    cluster has any). `placement_group` / `bundle_indices` / `gpu_fraction`: the caller's placement group and each
    replica's bundle(s) in it (see placement.py); None: the fleet makes one `STRICT_PACK` group per replica.
    `engine_kwargs`: `LLM`'s keyword arguments for every replica (dtype, max_model_len, num_kv_blocks, ...).
    Timeouts (seconds): `call_timeout` for control calls, `generate_timeout` for `generate`, `start_timeout` for a
    replica to start; every call also takes its own `timeout=`. `health_interval`: seconds between liveness pings
    of each replica (None: 0.5 s, longer past 100 replicas so the driver sends at most 200 pings a second; a death
    fails the replica's calls in flight at once anyway); `hang_timeout`: a ping unanswered this long marks the
    replica unresponsive."""

    def __init__(self, model: str | None = None, *, num_replicas: int, tensor_parallel_size: int = 1,
                 device: str = "auto", placement_group=None, bundle_indices=None, engine_kwargs: dict | None = None,
                 max_restarts: int = 3, gpu_fraction: float | None = None, num_cpus_per_replica: float = 1,
                 call_timeout: float = 120.0, generate_timeout: float = 600.0, start_timeout: float = 300.0,
                 health_interval: float | None = None, hang_timeout: float = 10.0) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        engine_kwargs = dict(engine_kwargs or {})
        for reserved in ("model", "device", "tensor_parallel_size"):
            if reserved in engine_kwargs:
                raise ValueError(f"engine_kwargs: give {reserved!r} as the fleet's own argument")
        if not ray.is_initialized():
            raise RuntimeError("RolloutFleet needs a Ray cluster: call ray.init() first")
        use_gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        self.model, self.tensor_parallel_size, self.max_restarts = model, tensor_parallel_size, max_restarts
        self.device = "cuda" if use_gpu else "cpu"
        self.engine_kwargs = {**engine_kwargs, "tensor_parallel_size": tensor_parallel_size}
        self.call_timeout, self.generate_timeout, self.start_timeout = call_timeout, generate_timeout, start_timeout
        if placement_group is None:
            if bundle_indices is not None:
                raise ValueError("bundle_indices needs placement_group (the group they index)")
            slots = own_slots(num_replicas, tensor_parallel_size, use_gpu, num_cpus_per_replica, start_timeout)
        else:
            slots = caller_slots(placement_group, bundle_indices, num_replicas, tensor_parallel_size, use_gpu,
                                 gpu_fraction, num_cpus_per_replica, start_timeout)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # replica states changed (restarts, health)
        self._replicas = [Replica(i, slot) for i, slot in enumerate(slots)]
        self._version: int | str = 0
        self._source = WeightSource(checkpoint=True, path=model)
        self._sleep_level: int | None = None
        self._paused: str | None = None        # pause_generation's mode while the fleet is paused
        self._woken: list[str] = []            # tags woken since the last sleep (a partial wake)
        self._groups: dict[str, dict[int, str]] = {}  # weights update group -> {replica: incarnation} joined
        self._affinity: OrderedDict[object, int] = OrderedDict()
        self._restarter = ThreadPoolExecutor(max(1, num_replicas), thread_name_prefix="torpor-fleet-restart")
        self._closed = False
        try:
            self._start_all()
        except BaseException:
            self._teardown()
            raise
        if health_interval is None:
            health_interval = max(0.5, num_replicas / 200)
        self._monitor = HealthMonitor(self._replicas, self._lock, self._on_dead, self._notify, health_interval,
                                      hang_timeout)

    # ---- starting replicas ----------------------------------------------------------------------------
    def _spawn(self, replica: Replica):
        options = replica.slot.actor_options()
        # wait_if_paused: requests a paused replica holds wait (the fleet's generate has its own deadline)
        return EngineActor.options(max_restarts=0, max_task_retries=0, **options).remote(
            self.model, self.device, self.engine_kwargs, replica.slot.visible_devices, replica.index,
            wait_if_paused=self.generate_timeout)

    def _start_all(self) -> None:
        handles = {r.index: self._spawn(r) for r in self._replicas}
        pings = {i: h.ping.remote() for i, h in handles.items()}
        results, errors, _ = gather(pings, self.start_timeout, "start-up")
        for replica in self._replicas:
            replica.handle = handles[replica.index]
            replica.incarnation = results.get(replica.index)
        if errors:
            raise FleetError("starting the fleet", errors)
        for replica in self._replicas:
            replica.state = "serving"
            replica.ready.set()

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, group_ids: list | None = None,
                 request_ids: list[str] | None = None, timeout: float | None = None) -> list:
        """Complete every prompt (text, token ids, or `{"prompt": ...}` / `{"prompt_token_ids": ...}`); one
        `RequestOutput` per prompt, in input order. `sampling_params`: one SamplingParams or one per prompt
        (`n` samples of a prompt stay on one replica). `group_ids`: None, or one hashable per prompt (None
        entries: no group); prompts of one group go to one replica. `request_ids`: one unique str per prompt (for
        `abort_requests`). While the fleet is paused the prompts wait for `resume_generation`. A replica that dies
        meanwhile has its
        prompts sent to the others; TimeoutError (FleetTimeoutError) after `timeout` names the replicas whose
        answers are missing; FleetError carries a replica's own error (bad input is refused by the replica as
        `LLM.generate` refuses it)."""
        prompts = prompt_list(prompts)
        if self._sleep_level is not None:
            raise RuntimeError(f"the fleet sleeps (level {self._sleep_level}"
                               f"{', woken: ' + ', '.join(self._woken) if self._woken else ''}): call wake_up() first")
        units = units_of(prompts, sampling_params, group_ids)
        if request_ids is not None:
            if not isinstance(request_ids, list | tuple) or len(request_ids) != len(prompts) or \
                    len(set(request_ids)) != len(prompts) or not all(isinstance(r, str) and r for r in request_ids):
                raise ValueError(f"request_ids must be {len(prompts)} distinct non-empty strings, one per prompt")
            for unit in units:
                unit.ids = [request_ids[i] for i in unit.indices]
        timeout = self.generate_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        outputs: list = [None] * len(prompts)
        pending: dict[ray.ObjectRef, tuple[Replica, list[Unit]]] = {}
        self._dispatch(units, pending, deadline)
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, min(left, 0.5)))
            if not ready:
                if left <= 0:
                    raise FleetTimeoutError("generate", {r.index: ReplicaTimeout(
                        f"{sum(len(u.indices) for u in us)} prompt(s) unanswered after {timeout:g} s")
                        for r, us in pending.values()})
                self._reroute_unresponsive(pending, deadline)
                continue
            for ref in ready:
                replica, batch = pending.pop(ref)
                try:
                    answers = ray.get(ref)
                except RayActorError as e:  # its prompts go to the others; a dead replica is restarted
                    if is_dead(e):
                        self._on_dead(replica)
                    else:
                        self._mark_unresponsive(replica, describe(e))
                    self._dispatch(batch, pending, deadline, avoid={replica.index})
                    continue
                except Exception as e:
                    raise FleetError("generate", {replica.index: unwrap(e)}) from None
                for unit, answer in zip(batch, _split(answers, batch), strict=True):
                    for index, output in zip(unit.indices, answer, strict=True):
                        outputs[index] = output
        return outputs

    async def generate_async(self, prompts, sampling_params=None, *, group_ids: list | None = None,
                             timeout: float | None = None) -> list:
        """`generate` for asyncio callers (it runs in a thread; many may run at once and share the replicas)."""
        return await asyncio.to_thread(self.generate, prompts, sampling_params, group_ids=group_ids, timeout=timeout)

    def _dispatch(self, units: list[Unit], pending: dict, deadline: float, avoid: set[int] = frozenset()) -> None:
        """Route `units` (least outstanding work, group affinity) and send one call per replica."""
        by_replica: dict[int, list[Unit]] = {}
        with self._lock:
            for unit in units:
                replica = self._route(unit, avoid, deadline)
                replica.outstanding += unit.weight
                by_replica.setdefault(replica.index, []).append(unit)
            for index, batch in by_replica.items():
                replica = self._replicas[index]
                prompts = [p for u in batch for p in u.prompts]
                params = [p for u in batch for p in u.params]
                if all(p is None for p in params):
                    params = None  # the model's default sampling parameters (LLM.generate's default)
                ids = [i for u in batch for i in u.ids] if batch[0].ids is not None else None
                ref = replica.handle.generate.remote(prompts, params, ids)
                weight = sum(u.weight for u in batch)
                ref.future().add_done_callback(lambda _, r=replica, w=weight: self._answered(r, w))
                pending[ref] = (replica, batch)

    def _route(self, unit: Unit, avoid: set[int], deadline: float) -> Replica:
        """The replica for `unit` (called locked): its group's, if that one serves; else the least loaded."""
        while True:
            candidates = [r for r in self._replicas if self._routable(r) and r.index not in avoid] or \
                [r for r in self._replicas if self._routable(r)]
            if candidates:
                break
            if not any(r.state in ("starting", "restarting", "unresponsive", "stale") for r in self._replicas) or \
                    time.monotonic() >= deadline:
                raise FleetError("generate", {r.index: RuntimeError(r.describe()) for r in self._replicas})
            self._changed.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        if unit.group is not None:
            index = self._affinity.get(unit.group)
            if index is not None and any(r.index == index for r in candidates):
                self._affinity.move_to_end(unit.group)
                return self._replicas[index]
        replica = min(candidates, key=lambda r: (r.outstanding, r.index))
        if unit.group is not None:
            self._affinity[unit.group] = replica.index
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        return replica

    def _routable(self, replica: Replica) -> bool:
        return replica.state == "serving" and replica.weight_version == self._version

    def _answered(self, replica: Replica, weight: int) -> None:
        with self._lock:
            replica.outstanding = max(0, replica.outstanding - weight)

    def _mark_unresponsive(self, replica: Replica, why: str) -> None:
        with self._lock:
            if replica.state == "serving":
                replica.state, replica.last_error = "unresponsive", why  # the health monitor revives it
                self._notify()

    def _reroute_unresponsive(self, pending: dict, deadline: float) -> None:
        """Send again, elsewhere, what waits on a replica the health monitor found unresponsive."""
        with self._lock:
            stuck = [ref for ref, (r, _) in pending.items() if r.state == "unresponsive"]
            if not stuck or not any(self._routable(r) for r in self._replicas):
                return
        for ref in stuck:
            replica, batch = pending.pop(ref)
            self._dispatch(batch, pending, deadline, avoid={replica.index})

    # ---- fleet-wide control --------------------------------------------------------------------------
    def sleep(self, level: int = 1, *, timeout: float | None = None) -> FleetResults:
        """Every replica sleeps at `level` (see `LLM.sleep`); per replica its memory report."""
        results = self._fan_out("sleep", (level,), timeout=timeout)
        self._sleep_level, self._woken = level, []
        return results

    def wake_up(self, tags: list[str] | None = None, *, timeout: float | None = None) -> FleetResults:
        """Every replica wakes `tags` (all when None); per replica its WakeResult."""
        results = self._fan_out("wake_up", (tags,), timeout=timeout)
        if tags is None or all(getattr(r, "serving", False) for r in results if r is not None):
            self._sleep_level, self._woken = None, []
        else:
            self._woken += [t for t in tags if t not in self._woken]
        return results

    def is_sleeping(self, *, timeout: float | None = None) -> bool:
        """Whether any replica sleeps (at any level: then the fleet does not serve fully)."""
        return any(bool(r) for r in self._fan_out("is_sleeping", timeout=timeout) if r is not None)

    def reset_prefix_cache(self, *, timeout: float | None = None) -> FleetResults:
        return self._fan_out("reset_prefix_cache", timeout=timeout)

    def collective_rpc(self, method: str, args: tuple | list = (), kwargs: dict | None = None, *,
                       timeout: float | None = None) -> FleetResults:
        """`LLM.collective_rpc` on every replica: per replica its list of per-rank results."""
        return self._fan_out("collective_rpc", (method, tuple(args), kwargs), timeout=timeout)

    def reload_weights(self, path: str | None = None, *, weight_version: int | str | None = None,
                       timeout: float | None = None) -> FleetResults:
        """Every replica reloads the checkpoint at `path` (None: the fleet's model)."""
        return self._update("reload_weights", (path,), weight_version, WeightSource(checkpoint=True, path=path),
                            timeout)

    def update_weights_from_tensor(self, named_tensors=None, load_format: str | None = None, flush_cache: bool = True,
                                   serialized_named_tensors: list | None = None, *,
                                   weight_version: int | str | None = None, source=None,
                                   timeout: float | None = None) -> FleetResults:
        """`LLM.update_weights_from_tensor` on every replica. `serialized_named_tensors`: one list of per-rank
        payloads for every replica (CPU shared memory, or one GPU they all share), or a list of such lists, one
        per replica (CUDA IPC from the trainer worker on each replica's own GPU). `named_tensors`: tensors by
        value (through Ray's object store). `source`: all of this version's weights again, for a restarted replica
        (an ObjectRef of `[(name, tensor)]` or a `{name: tensor}` dict); give it with any one call of a push made
        of several calls (buckets) with the same `weight_version`. `named_tensors` are not kept on their own: they
        may be one bucket of several."""
        per_replica = serialized_named_tensors is not None and bool(serialized_named_tensors) and all(
            isinstance(p, list | tuple) for p in serialized_named_tensors)
        if per_replica and len(serialized_named_tensors) != len(self._replicas):
            raise ValueError(f"serialized_named_tensors: {len(serialized_named_tensors)} per-replica lists for "
                             f"{len(self._replicas)} replicas")
        if named_tensors is not None and not isinstance(named_tensors, ray.ObjectRef):
            named_tensors = ray.put(named_tensors)  # once into the object store, not once per replica
        args = {i: (named_tensors, load_format, flush_cache,
                    list(serialized_named_tensors[i]) if per_replica else serialized_named_tensors)
                for i in range(len(self._replicas))}
        return self._update("update_weights_from_tensor", args, weight_version, WeightSource(tensors=source), timeout)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None, *,
                                  group_timeout: float = 120.0, timeout: float | None = None) -> FleetResults:
        """Every replica joins the trainer's group `group_name`: replica i's ranks at rank_offset + i·TP (the
        trainer, rank 0, hosts the store at master_address:master_port and joins at the same time). A replica that
        failed for good is left out and the ones after it move up (size the group with `group_world_size()`)."""
        tp = self.tensor_parallel_size
        if not isinstance(rank_offset, int) or rank_offset < 1:
            raise ValueError(f"rank_offset must be an int >= 1 (rank 0 is the trainer), got {rank_offset!r}")

        def args(targets: list[int]) -> dict[int, tuple]:
            if isinstance(world_size, int) and world_size < rank_offset + len(targets) * tp:
                raise ValueError(f"world_size {world_size} cannot hold {len(targets)} replica(s) of {tp} rank(s) "
                                 f"from rank_offset {rank_offset} (needs {rank_offset + len(targets) * tp})")
            return {i: (master_address, master_port, rank_offset + k * tp, world_size, group_name, backend,
                        group_timeout) for k, i in enumerate(targets)}

        results = self._fan_out("init_weights_update_group", args, timeout=timeout, strict=False)
        with self._lock:
            self._groups[group_name] = {i: self._replicas[i].incarnation for i, _ in enumerate(results)
                                        if i not in results.excluded and i not in getattr(results, "failed", {})}
        self._raise_failed("init_weights_update_group", results)
        return results

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True, *,
                                        weight_version: int | str | None = None, source=None,
                                        timeout: float | None = None) -> FleetResults:
        """Every replica receives the trainer's broadcast of `names` over `group_name` at once (the trainer
        broadcasts while this call waits). Refused at once if a replica of the group restarted since it formed
        (the group must be formed again with the trainer). `source`: see `update_weights_from_tensor`."""
        with self._lock:
            members = self._groups.get(group_name)
            if members is None:
                raise ValueError(f"no weights update group {group_name!r}: call init_weights_update_group first")
            gone = [r.index for r in self._replicas if members.get(r.index) != r.incarnation or r.state not in LIVE]
        if gone:
            raise FleetError("update_weights_from_distributed", {i: RuntimeError(
                f"not in weights update group {group_name!r} (restarted or gone since it formed: destroy the group "
                f"and init it again with the trainer)") for i in gone})
        return self._update("update_weights_from_distributed", (names, dtypes, shapes, group_name, flush_cache),
                            weight_version, WeightSource(tensors=source), timeout)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group", *,
                                     timeout: float | None = None) -> FleetResults:
        """Every replica in the group leaves it (replicas restarted since were never in it)."""
        with self._lock:
            members = self._groups.pop(group_name, {})
        include = {i for i, incarnation in members.items() if self._replicas[i].incarnation == incarnation}
        return self._fan_out("destroy_weights_update_group", (group_name,), timeout=timeout, only=include)

    # ---- pause, abort, the weights' label (vLLM's names; each replica's engine does it) ---------------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True, *,
                         timeout: float | None = None) -> FleetResults:
        """Every replica pauses (`LLM.pause_generation`): "abort" ends the requests in flight (`generate` returns
        them with the tokens they have, finish_reason "abort"), "wait" lets the running ones finish first, "keep"
        freezes them with their KV (recomputed after the resume when `clear_cache`), "retract". Requests sent
        meanwhile wait for `resume_generation`. If a replica refuses, the ones that paused are resumed and
        FleetError names the refusals."""
        with self._lock:
            before, self._paused = self._paused, mode  # a replica restarted from now on starts paused
        results = self._fan_out("pause_generation", (mode, clear_cache), timeout=timeout, strict=False)
        failed = getattr(results, "failed", {})
        if failed:
            with self._lock:
                self._paused = before
            if before is None:
                paused = {i for i in range(len(self._replicas)) if i not in failed and i not in results.excluded}
                self._fan_out("resume_generation", only=paused, timeout=timeout, strict=False)
            self._raise_failed("pause_generation", results)
        return results

    def resume_generation(self, *, timeout: float | None = None) -> FleetResults:
        """Every replica resumes: requests held during the pause run."""
        results = self._fan_out("resume_generation", timeout=timeout)
        with self._lock:
            self._paused = None
        return results

    def is_paused(self) -> bool:
        return self._paused is not None

    def abort_requests(self, request_ids: list[str] | None = None, *, timeout: float | None = None) -> FleetResults:
        """Abort the requests with these ids (None: every request in flight) on every replica, without pausing;
        their `generate` returns them (finish_reason "abort"). Per replica: how many it aborted."""
        return self._fan_out("abort_requests", (None if request_ids is None else list(request_ids),),
                             timeout=timeout)

    def update_weight_version(self, new_version: int | str, *, timeout: float | None = None) -> FleetResults:
        """Relabel the weights served (not touched): every replica at the fleet's version takes the new label,
        and so does a replica restarted later; a stale one keeps its own until an update reaches it."""
        with self._lock:
            current = {r.index for r in self._replicas if r.weight_version == self._version}
        results = self._fan_out("update_weight_version", (new_version,), timeout=timeout, only=current)
        with self._lock:
            self._version = new_version
            for i in current - set(results.excluded):
                self._replicas[i].weight_version = new_version
            self._notify()
        return results

    def get_weight_version(self) -> int | str:
        return self._version

    # ---- state --------------------------------------------------------------------------------------
    @property
    def replicas(self) -> list:
        """The replicas' actor handles, in order (None for one being restarted or failed for good)."""
        with self._lock:
            return [r.handle if r.state in LIVE else None for r in self._replicas]

    @property
    def weight_version(self) -> int | str:
        return self._version

    def group_world_size(self, rank_offset: int = 1) -> int:
        """The world size of a weights update group over every replica not failed for good: rank_offset + their
        ranks (a restarting replica counts: `init_weights_update_group` waits for it)."""
        with self._lock:
            return rank_offset + sum(r.state != "failed" for r in self._replicas) * self.tensor_parallel_size

    def stats(self, *, timeout: float | None = None) -> list[dict]:
        """Per replica: the fleet's view (state, restarts, outstanding sequences, weight version) and the
        replica's own (`EngineActor.stats`: serving, queue, KV cache, requests served); a replica that does not
        answer within `timeout` (default: `call_timeout`, at most 5 s) has "error" instead."""
        with self._lock:
            live = {r.index: r.handle for r in self._replicas if r.state in LIVE}
        refs = {i: h.stats.remote() for i, h in live.items()}
        answers, errors, _ = gather(refs, min(self.call_timeout, 5.0) if timeout is None else timeout, "stats")
        rows = []
        with self._lock:
            for r in self._replicas:
                row = {"replica": r.index, "state": r.state, "restarts": r.restarts, "outstanding": r.outstanding,
                       "weight_version": r.weight_version, "last_error": r.last_error}
                row.update({k: v for k, v in (answers.get(r.index) or {}).items() if k not in row})
                if r.index in errors:
                    row["error"] = describe(errors[r.index])
                rows.append(row)
        return rows

    def shutdown(self) -> None:
        """Stop every replica and give back the placement groups the fleet made."""
        if self._closed:
            return
        self._closed = True
        self._monitor.stop()
        self._teardown()

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _teardown(self) -> None:
        self._closed = True
        self._restarter.shutdown(wait=False, cancel_futures=True)
        handles = {r.index: r.handle for r in self._replicas if r.handle is not None}
        if handles:
            gather({i: h.close.remote() for i, h in handles.items()}, 10.0, "close")
            for handle in handles.values():
                ray.kill(handle, no_restart=True)
        for r in self._replicas:
            r.state, r.handle = "stopped", None
        release([r.slot for r in self._replicas])

    # ---- fan-out ------------------------------------------------------------------------------------
    def _fan_out(self, method: str, args=(), *, timeout: float | None = None, only: set[int] | None = None,
                 strict: bool = True) -> FleetResults:
        """`method` on every live replica at once (`args`: one tuple for all, {replica: tuple}, or a function of the
        replicas reached, in order, giving that dict). Waits within
        the timeout for replicas that are restarting; those still not live are `excluded`. strict: raise
        FleetError if any replica failed (else the failures are on the results' `failed`)."""
        timeout = self.call_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(r.state in ("starting", "restarting") for r in self._replicas) and time.monotonic() < deadline:
                self._changed.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            asked = [r for r in self._replicas if only is None or r.index in only]
            targets = {r.index: r.handle for r in asked if r.state in LIVE}
            excluded = {r.index: r.describe() for r in asked if r.index not in targets}
        if callable(args):  # built from the replicas the call reaches (their number and order)
            args = args(sorted(targets))
        refs = {i: getattr(h, method).remote(*(args[i] if isinstance(args, dict) else args))
                for i, h in targets.items()}
        answers, errors, _ = gather(refs, max(0.0, deadline - time.monotonic()), method,
                                    on_dead=lambda i: self._on_dead(self._replicas[i]), stated_s=timeout)
        results = FleetResults([answers.get(r.index) for r in self._replicas], excluded)
        results.failed = errors
        if strict:
            self._raise_failed(method, results)
        return results

    @staticmethod
    def _raise_failed(method: str, results: FleetResults) -> None:
        errors = getattr(results, "failed", {})
        if errors:
            kind = FleetTimeoutError if all(isinstance(e, TimeoutError) for e in errors.values()) else FleetError
            raise kind(method, errors, results)

    def _update(self, method: str, args, weight_version, source: WeightSource, timeout: float | None) -> FleetResults:
        """A weight update on every replica; the fleet's version moves to `weight_version` (None: +1) if any
        replica took it; replicas that did not are "stale" (no requests) until a later update reaches them."""
        with self._lock:
            version = weight_version if weight_version is not None else _next(self._version)
        results = self._fan_out(method, args, timeout=timeout, strict=False)
        failed = getattr(results, "failed", {})
        took = [i for i in range(len(self._replicas)) if i not in failed and i not in results.excluded]
        with self._lock:
            if took:
                if source.kept or version != self._version:  # a push in several calls: its source given once
                    self._source = source
                self._version = version
                for i in took:
                    self._replicas[i].weight_version = version
                    self._replicas[i].handle.update_weight_version.remote(version)  # in order, after the update
                    if self._replicas[i].state == "stale":  # caught up
                        self._replicas[i].state, self._replicas[i].last_error = "serving", None
                for r in self._replicas:
                    if r.index not in took and r.state == "serving":
                        r.state, r.last_error = "stale", f"missed weight update to version {version}"
            self._notify()
        self._raise_failed(method, results)
        return results

    # ---- failures and restarts ----------------------------------------------------------------------
    def _notify(self) -> None:
        with self._lock:
            self._changed.notify_all()

    def _on_dead(self, replica: Replica) -> None:
        """A replica's actor died: restart it (once per death) or mark it failed."""
        with self._lock:
            if self._closed or replica.state not in LIVE:
                return
            replica.last_error = "its actor died"
            if replica.restarts >= self.max_restarts:
                replica.state = "failed"
                self._notify()
                return
            replica.state, replica.restarts = "restarting", replica.restarts + 1
            replica.ready.clear()
            old, replica.handle = replica.handle, None
            self._notify()
        self._restarter.submit(self._restart, replica, old)

    def _restart(self, replica: Replica, old) -> None:
        """A new actor on the replica's bundle(s), brought to the fleet's weights; tried again (within
        `max_restarts`) if it fails to start."""
        with contextlib.suppress(Exception):  # gone already, most likely; a hung one is ended here
            ray.kill(old, no_restart=True)
        while True:
            handle = None
            try:
                handle = self._spawn(replica)
                incarnation = ray.get(handle.ping.remote(), timeout=self.start_timeout)
                state = self._catch_up(replica, handle)
                break
            except Exception as e:
                if handle is not None:
                    with contextlib.suppress(Exception):
                        ray.kill(handle, no_restart=True)
                with self._lock:
                    replica.last_error = f"restart failed: {describe(e)}"
                    if self._closed or replica.restarts >= self.max_restarts:
                        replica.state = "failed"
                        replica.ready.set()
                        self._notify()
                        return
                    replica.restarts += 1
        with self._lock:
            replica.handle, replica.incarnation, replica.state = handle, incarnation, state
            replica.ready.set()
            self._notify()

    def _catch_up(self, replica: Replica, handle) -> str:
        """Bring a new incarnation to the fleet's weights and sleep state; returns its state ("serving", or
        "stale" when the fleet's current weights were not kept)."""
        timeout = self.start_timeout
        while True:
            with self._lock:
                version, source = self._version, self._source
            if version != 0 and not source.kept:
                replica.weight_version = 0  # the checkpoint's
                replica.last_error = (f"restarted; the weights of version {version} were not kept (pass source= to "
                                      "the update): it waits for the next update")
                state = "stale"
                break
            if source.checkpoint and source.path is not None and source.path != self.model:
                ray.get(handle.reload_weights.remote(source.path), timeout=timeout)
            elif source.tensors is not None:
                ray.get(handle.update_weights.remote(source.tensors), timeout=timeout)
            ray.get(handle.update_weight_version.remote(version), timeout=timeout)
            with self._lock:
                if self._version == version:
                    replica.weight_version, state = version, "serving"
                    break
        with self._lock:
            level, woken, paused = self._sleep_level, list(self._woken), self._paused
        if level is not None:
            ray.get(handle.sleep.remote(level), timeout=timeout)
            if woken:
                ray.get(handle.wake_up.remote(woken), timeout=timeout)
        if paused is not None:
            ray.get(handle.pause_generation.remote(paused, False), timeout=timeout)
        return state


def _next(version: int | str) -> int | str:
    return version + 1 if isinstance(version, int) else f"{version}+1"


def _split(answers: list, batch: list[Unit]) -> list[list]:
    """A replica's answers to a batch of units, cut back into one list per unit."""
    counts = [len(u.indices) for u in batch]
    it = iter(answers)
    return [list(itertools.islice(it, c)) for c in counts]


__all__ = ["FleetError", "FleetResults", "FleetTimeoutError", "RolloutFleet", "Slot", "WeightSource"]
