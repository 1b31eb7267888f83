"""Continuous batching (torch-free): which sequences run in the next forward pass.

Each step is either one prefill batch (new or preempted sequences, whole; no chunking) or one
decode batch (every running sequence, one token each). Prefill goes first so new requests join
the running batch as soon as blocks allow. When decode runs out of KV blocks, the most recently
arrived sequences are preempted by recompute: their blocks are freed and they go back to the
front of the queue, to be prefilled again (prompt + outputs so far) when blocks free up.

A request with n samples (`SamplingParams.n`) is admitted whole: its prefill computes the prompt once
(sample 0) and forks the other samples from it in the same step (`BlockManager.fork`: full prompt
blocks shared, the partial last block copied by the model runner after the forward pass). With prefix
caching off the samples are independent sequences that each compute the prompt (vLLM's behaviour).

Liveness: `EngineConfig` guarantees the KV cache holds max_model_len tokens and a prefill batch
max_model_len tokens, and `LLMEngine.make_sequence` rejects prompts that leave no room for their
output tokens, so the oldest sequence can always run; nothing livelocks.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import deque
from collections.abc import Iterable

from torpor.engine.block_manager import BlockManager
from torpor.engine.config import EngineConfig
from torpor.engine.lifecycle import Lifecycle
from torpor.engine.outputs import FinishReason, TokenLogprobs
from torpor.engine.sequence import FINISHED, Sequence, SequenceStatus


def _arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler:
    """Owns the waiting queue, the running batch and the KV block allocator. It steps only while `lifecycle` lets
    it (`may_run`) and starts new requests only while it may admit (`may_admit`); without one it always does."""

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] = (), lifecycle: Lifecycle | None = None):
        if config.num_kv_blocks is None:
            raise ValueError("config.num_kv_blocks is not set: profile memory and use "
                             "config.with_num_kv_blocks(n) before building the scheduler")
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []           # sorted by arrival, oldest first
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle((), ())
        self._requests: dict[str, list[Sequence]] = {}  # unfinished requests: their samples in index order
        self._arrivals = itertools.count()
        # Seeds of unseeded requests, drawn in arrival order: an engine run is reproducible
        # from config.seed alone.
        self._seed_rng = random.Random(config.seed)

    # --- requests in and out -------------------------------------------------------------
    def add(self, seq: Sequence) -> list[Sequence]:
        """Queue a new request (its sample 0); returns its n sequences in index order. Raises ValueError if
        it can never be served."""
        if seq.request_id in self._requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.num_output_tokens or seq.block_table or seq.index:
            raise ValueError(f"request {seq.request_id!r} was already scheduled ({seq!r})")
        self.check_n(seq.sampling_params.n, len(seq))
        n = seq.sampling_params.n
        seq.arrival = next(self._arrivals)
        if seq.sampling_seed is None:
            seq.sampling_seed = self._seed_rng.getrandbits(64)
        samples = [seq] + [seq.fork(i) for i in range(1, n)]
        for sample in samples[1:]:
            sample.arrival = seq.arrival
        if self.config.enable_prefix_caching:
            seq.pending_forks = samples[1:]  # forked by the prefill of sample 0
            self.waiting.append(seq)
        else:
            self.waiting.extend(samples)
        self._requests[seq.request_id] = samples
        return samples

    def check_n(self, n: int, num_prompt_tokens: int) -> None:
        """ValueError naming `n` unless n samples of such a prompt can be admitted together."""
        limit = min(self.config.max_n, self.config.max_num_seqs)
        if n > limit:
            raise ValueError(f"n must be <= {limit} (the engine's max_n {self.config.max_n} and max_num_seqs "
                             f"{self.config.max_num_seqs}), got {n}")
        bm = self.block_manager  # admitted together: the prompt's blocks plus a last block per forked sample
        if n > 1 and bm.enable_prefix_caching and bm.num_blocks_for(num_prompt_tokens) + n - 1 > bm.num_blocks:
            raise ValueError(f"n={n} samples of a {num_prompt_tokens}-token prompt do not fit in the KV cache "
                             f"({bm.num_blocks} blocks of {bm.block_size} tokens)")

    def samples(self, request_id: str) -> list[Sequence]:
        """The sequences of an unfinished request, in index order ([] if there is none)."""
        return self._requests.get(request_id, [])

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End `seq` now (stop string found by the engine, abort, ...) and free its blocks. Samples still
        waiting to be forked from it end with it (they share its fate until its prefill)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.deallocate(seq)
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        for sample in [seq, *seq.pending_forks]:
            sample.status = SequenceStatus.FINISHED
            sample.finish_reason = reason
            sample.stop_reason = stop_reason
        seq.pending_forks = []
        samples = self._requests.get(seq.request_id, [])
        if all(sample.is_finished for sample in samples):
            self._requests.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish every unfinished sample of a request with reason 'abort'; returns its sample 0, or None if
        there is no such request."""
        samples = self._requests.get(request_id)
        if samples is None:
            return None
        for sample in samples:
            self.finish(sample, "abort")
        return samples[0]

    def is_finished(self) -> bool:
        """True when no request waits or runs."""
        return not self._requests

    # --- scheduling ----------------------------------------------------------------------
    def has_runnable(self) -> bool:
        """Whether `schedule` would return a batch: a sequence runs, or waits and may start."""
        if not self.lifecycle.may_run():
            return False
        return bool(self.running) or (bool(self.waiting) and self.lifecycle.may_admit())

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next batch and whether it is a prefill. Empty when the lifecycle stops the steps, or idle."""
        if not self.lifecycle.may_run():
            return [], False
        seqs = self._schedule_prefill() if self.lifecycle.may_admit() else []
        if seqs:
            return seqs, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        num_tokens = 0
        bm = self.block_manager
        while self.waiting:
            seq = self.waiting[0]
            num_forks, use_cache = len(seq.pending_forks), self._may_use_cache(seq)
            num_new = seq.num_new_tokens - bm.num_hit_tokens_for(seq, use_cache)
            if (len(self.running) + 1 + num_forks > self.config.max_num_seqs
                    or num_tokens + num_new > self.config.max_num_batched_tokens
                    or not bm.can_allocate(seq, num_forks, use_cache)):
                break
            self.waiting.popleft()
            bm.allocate(seq, use_cache)
            scheduled.append(self._start(seq))
            scheduled += [self._fork(seq, child) for child in seq.pending_forks]
            seq.pending_forks = []
            num_tokens += seq.num_new_tokens
        return scheduled

    @staticmethod
    def _may_use_cache(seq: Sequence) -> bool:
        """Prompt logprobs need the hidden state of every prompt position: such a request computes its whole
        prompt at its first prefill (its blocks still serve others)."""
        return seq.sampling_params.prompt_logprobs is None or seq.prompt_logprobs is not None

    def _start(self, seq: Sequence) -> Sequence:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_arrival)
        return seq

    def _fork(self, parent: Sequence, child: Sequence) -> Sequence:
        """`child` joins the step that prefills `parent` (right after it in the batch)."""
        child.fork_copy = self.block_manager.fork(parent, child)
        child.shares_prefill = True
        return self._start(child)

    def _schedule_decode(self) -> list[Sequence]:
        bm, running = self.block_manager, self.running
        if bm.append_all(running):  # blocks for every one: no preemption (most steps)
            return list(running)
        # Oldest first: a sequence that needs a block takes it from the newest ones.
        scheduled: list[Sequence] = []
        while len(scheduled) < len(running):
            seq = running[len(scheduled)]
            if not bm.can_append(seq):
                while not bm.can_append(seq) and running[-1] is not seq:
                    self._preempt(running.pop())
                if not bm.can_append(seq):
                    # `seq` is the newest left: it yields to the older, already scheduled ones.
                    self._preempt(running.pop())
                    break
            bm.may_append(seq)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-preemption: drop the KV blocks, requeue at the front."""
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def retract(self) -> int:
        """Every running sequence back to the front of the waiting queue, oldest first (SGLang's retract, vLLM's
        reset of running requests): its KV blocks go, and its next prefill recomputes prompt and outputs. Returns
        how many went back."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running.pop())
        return count

    def reset_blocks(self) -> None:
        """Forget all KV-cache contents (the cache was discarded by sleep): running sequences
        are preempted (they recompute later) and the allocator returns to its cold state."""
        self.retract()
        self.block_manager.reset()

    # --- results -------------------------------------------------------------------------
    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list[TokenLogprobs | None] | None = None,
                    routed_experts: list | None = None, weight_version: str | None = None) -> list[Sequence]:
        """Append each sequence's sampled token (its logprobs, its routed experts: `SamplerOutput`'s; the label of
        the weights that sampled it) and finish those that hit a stop condition (eos unless ignore_eos,
        stop_token_ids, max_tokens, max_model_len). Stop strings need text: the engine checks them after
        detokenizing and calls `finish(seq, "stop", s)`. Returns the sequences finished here."""
        if len(token_ids) != len(seqs) or (logprobs is not None and len(logprobs) != len(seqs)):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} tokens / "
                             f"{None if logprobs is None else len(logprobs)} logprobs")
        finished = []
        logprobs = logprobs or itertools.repeat(None, len(seqs))
        routed_experts = routed_experts or itertools.repeat(None, len(seqs))
        for seq, token_id, token_logprobs, routed in zip(seqs, token_ids, logprobs, routed_experts, strict=True):
            if seq.status is FINISHED:  # aborted while its step ran: drop the token
                continue
            seq.append_token(token_id, token_logprobs, routed, weight_version)
            reason, stop_reason = self._check_stop(seq, token_id)
            if reason is not None:
                self.finish(seq, reason, stop_reason)
                finished.append(seq)
        return finished

    def _check_stop(self, seq: Sequence, token_id: int) -> tuple[FinishReason | None, int | None]:
        params = seq.sampling_params
        if token_id in params.stop_token_ids:
            return "stop", token_id
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop", None
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.config.max_model_len:
            return "length", None
        return None, None
