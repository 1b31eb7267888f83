"""Rank 0 of a tensor-parallel engine: a ModelRunner here plus the workers (ranks 1..N-1), behind the
interface `LLMEngine` already uses (`run`, `reload_weights`, `update_weights`, and a memory whose
`sleep` / `wake` reach every rank). Rank 0 schedules and samples; the other ranks only run forward passes.

Every command goes to the workers first, then runs here, then waits for all replies, so it returns when
every rank finished; a failure on any rank raises that rank's error (`RankError`, with its rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torpor.engine.config import EngineConfig
from torpor.engine.distributed import check_divisible, check_exchange
from torpor.engine.model_runner import ModelRunner
from torpor.engine.models import ModelConfig
from torpor.engine.sampler import SamplerOutput
from torpor.engine.sequence import Sequence
from torpor.engine.step_batch import StepBatch
from torpor.engine.worker import rank_info, sleep_rank, wake_rank
from torpor.engine.worker_group import RankError, WorkerGroup, end_tensors, send_tensors

STEP_FAILURE_WAIT_S = 10.0  # a step failed on rank 0: how long the workers may take to answer it


class ParallelModelRunner:
    """`memory` is rank 0's MemoryManager (None: no sleep mode on any rank). `worker_memory_options`:
    rank -> MemoryManager keyword arguments of that worker (e.g. a per-rank `max_host_bytes`)."""

    def __init__(self, config: EngineConfig, memory=None, worker_memory_options: dict[int, dict] | None = None) -> None:
        check_divisible(ModelConfig.from_pretrained(config.model), config.tensor_parallel_size)
        options = None if memory is None else (worker_memory_options or {})
        self.workers = WorkerGroup(config, options)
        try:
            self.local = ModelRunner(config, memory)  # meets the workers' start-up in its collectives
            _, errors = self.workers.collect("start-up")
            if errors:
                raise errors[min(errors)]
        except BaseException as e:
            # A worker that failed first explains it best (rank 0 then fails in a collective with it).
            errors = self.workers.early_errors() if isinstance(e, Exception) else {}
            self.workers.close(healthy=False)  # workers may be blocked in a start-up collective
            if errors:
                raise errors[min(errors)] from e
            raise
        self.config, self.model_config, self.device = self.local.config, self.local.model_config, self.local.device
        self.memory = None if memory is None else ParallelMemory(memory, self)

    @property
    def kv_cache(self):
        """Rank 0's KV cache (its kv heads)."""
        return self.local.kv_cache

    def on_all_ranks(self, what: str, args: tuple, local: Callable, ranks: list[int] | None = None,
                     failed_here_wait_s: float | None = None) -> tuple[object, dict[int, BaseException]]:
        """Send `what` to the workers, run `local()` here, wait for everyone. Returns rank 0's result
        and the errors by rank (rank 0's included); a dead or silent worker raises WorkerDiedError.
        `failed_here_wait_s`: when `local()` failed, wait only this long for the workers (they may be
        blocked in a collective rank 0 will never join)."""
        self.workers.send(what, *args, ranks=ranks)
        result, errors = None, {}
        try:
            result = local()
        except Exception as e:
            errors[0] = e
        try:
            _, worker_errors = self.workers.collect(what, ranks, failed_here_wait_s if errors else None)
        except RuntimeError as died:
            raise died from errors.get(0)
        errors.update(worker_errors)
        return result, errors

    def _everywhere(self, what: str, args: tuple, local: Callable, failed_here_wait_s: float | None = None):
        result, errors = self.on_all_ranks(what, args, local, failed_here_wait_s=failed_here_wait_s)
        if errors:
            raise errors[min(errors)]  # rank 0's own exception as is, a worker's as a RankError
        return result

    def run(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        """One step on every rank. A step that fails on any rank leaves the engine unusable (the ranks'
        collectives may be out of step): a worker exits after replying its error; a failure here waits
        STEP_FAILURE_WAIT_S for the workers, then gives them up."""
        def local() -> SamplerOutput:
            output = self.local.run(seqs, is_prefill)
            check_exchange()
            return output

        return self._everywhere("run", (StepBatch.pack(seqs, is_prefill),), local,
                                failed_here_wait_s=STEP_FAILURE_WAIT_S)

    def reload_weights(self, path: str) -> None:
        self._everywhere("reload_weights", (path,), lambda: self.local.reload_weights(path))

    def update_weights(self, named_tensors, strict: bool, reset_buffers: bool = True,
                       staged: bool = False) -> int:
        """Every rank receives every tensor (it keeps its shard), streamed one at a time: its name through
        the pipes, its data broadcast over the process group from rank 0's device. `reset_buffers` and
        `staged`: as `ModelRunner.update_weights`, on every rank."""
        conns = self.workers.conns
        if isinstance(named_tensors, list | tuple):  # the whole update, before any rank writes
            self.local.check_update(named_tensors, strict, staged)

        def local() -> int:
            try:
                return self.local.update_weights(send_tensors(conns, named_tensors, self.device), strict,
                                                 reset_buffers)
            finally:
                end_tensors(conns)

        return self._everywhere("update_weights", (strict, reset_buffers), local)

    def reset_buffers(self) -> None:
        """Recompute the buffers no checkpoint holds (the RoPE table) on every rank."""
        self._everywhere("reset_buffers", (), self.local.reset_buffers)

    @property
    def weights_valid(self) -> bool:
        """Rank 0's weights are whole (see ModelRunner.weights_valid)."""
        return self.local.weights_valid

    def rank_usage(self) -> list[dict]:
        """Every rank's device, device memory in use, tags and CUDA graphs (`worker.rank_info`), rank order."""
        self.workers.send("info")
        results, errors = self.workers.collect("info")
        if errors:
            raise errors[min(errors)]
        return [rank_info(self.local, None if self.memory is None else self.memory.local)] + \
            [results[rank] for rank in sorted(results)]

    def close(self) -> None:
        """Stop the workers and leave the process group; this engine cannot run any more."""
        self.local.close()  # its graphs (they captured NCCL calls) go before the communicator
        self.workers.close()

    def weights_group(self, op: str, *args):
        """A trainer's weights update group on every rank (weight_transfer.rank_command: init, receive,
        apply, drop, destroy); every rank joins as rank_offset + its rank and keeps its own shard."""
        from torpor.engine.weight_transfer import rank_command

        return self._everywhere("weights_group", (op, *args), lambda: rank_command(self.local, op, *args))


class ParallelMemory:
    """Rank 0's MemoryManager for every query; `sleep` and `wake` act on every rank. A sleep that fails
    on any rank is rolled back on the others (they wake again), so no rank stays half asleep."""

    def __init__(self, local, runner: ParallelModelRunner) -> None:
        self.local, self.runner = local, runner

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def sleep(self, actions: Mapping[str, str]):
        awake_before = [t for t in actions if not self.local.is_sleeping(t)]
        report, errors = self.runner.on_all_ranks("sleep", (actions,), lambda: sleep_rank(self.local, actions))
        if errors:
            self._roll_back(awake_before, actions)
            first = min(errors)
            raise errors[first] if first else RankError(0, errors[0])
        return report

    def _roll_back(self, tags: list[str], actions: Mapping[str, str]) -> None:
        """Wake what the failed sleep put to sleep (ranks where it failed left everything awake); weights
        it discarded come back from the checkpoint."""
        self.runner.on_all_ranks("wake", (tags,), lambda: wake_rank(self.local, tags))
        if "weights" in tags and str(actions["weights"]) == "discard":
            self.runner.reload_weights(self.runner.config.model)

    def wake(self, tags=None):
        """Wake on every rank. A failure raises (retry: tags already awake are skipped)."""
        tags = None if tags is None else list(tags)
        report, errors = self.runner.on_all_ranks("wake", (tags,), lambda: wake_rank(self.local, tags))
        if errors:
            first = min(errors)
            raise errors[first] if first else RankError(0, errors[0])
        return report

