"""`SymmetricMemory.map`'s ending over a real process group (two gloo processes): every rank agrees on the
outcome, so a rank that failed to map its part makes every rank release its mappings and raise at once, not at
the group's timeout. The driver's part (`_map_slots`: cuMemCreate, the descriptor exchange, cuMemMap) needs
two GPUs (tests/gpu/test_tensor_exchange.py); here a rank's part succeeds or raises as the case says."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torpor.engine.distributed import TPGroup
from torpor.engine.symmetric_memory import SymmetricMemory
from torpor.rl.engine_process import free_port

GROUP_TIMEOUT_S = 60


class _Slots(SymmetricMemory):
    """The agreement of `map` with this rank's own part either made (a mapping recorded) or failed."""

    def __init__(self, agree, fails: bool) -> None:  # no device: the part `map` agrees on is given
        self.agree, self.fails, self._handles, self.released = agree, fails, [], 0

    def _map_slots(self) -> None:
        if self.fails:
            raise RuntimeError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY")
        self._handles.append((0, "mapping"))

    def _release(self, unmapped: dict) -> None:
        self.released += len(self._handles)
        self._handles = []


def _rank(rank: int, port: int, failing: list[int], results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=GROUP_TIMEOUT_S))
    group = TPGroup.join(rank, 2, store, torch.device("cpu"), timeout_s=GROUP_TIMEOUT_S)  # the engine's own group
    try:
        slots = _Slots(group.all_ok, fails=rank in failing)
        start = time.monotonic()
        try:
            slots.map()
            outcome = "mapped"
        except RuntimeError as e:
            outcome = str(e)
        results.put((rank, outcome, slots.is_mapped, slots.released, time.monotonic() - start))
    finally:
        group.shutdown()


def _run(failing: list[int]) -> dict[int, tuple]:
    port = free_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, failing, results)) for rank in range(2)]
    for p in processes:
        p.start()
    outcomes = {}
    for _ in processes:
        rank, *rest = results.get(timeout=GROUP_TIMEOUT_S + 30)
        outcomes[rank] = tuple(rest)
    for p in processes:
        p.join(30)
        assert p.exitcode == 0
    return outcomes


def test_every_rank_maps_when_every_part_succeeds():
    outcomes = _run(failing=[])
    assert {rank: o[:3] for rank, o in outcomes.items()} == {0: ("mapped", True, 0), 1: ("mapped", True, 0)}


def test_one_rank_failing_makes_every_rank_release_and_raise_at_once():
    outcomes = _run(failing=[1])
    outcome, mapped, released, seconds = outcomes[0]
    assert "another tensor-parallel rank failed to map" in outcome
    assert not mapped and released == 1  # rank 0 gave back the mapping it had made
    assert seconds < GROUP_TIMEOUT_S / 4, f"rank 0 waited {seconds:.1f} s: it learned of the failure at the timeout"
    assert outcomes[1][0] == "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY" and not outcomes[1][1]
