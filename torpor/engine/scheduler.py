"""Continuous batching (torch-free): which sequences run in the next forward pass.

Each step is either one prefill batch (new or preempted sequences, whole; no chunking) or one
decode batch (every running sequence, one token each). Prefill goes first so new requests join
the running batch as soon as blocks allow. When decode runs out of KV blocks, the most recently
arrived sequences are preempted by recompute: their blocks are freed and they go back to the
front of the queue, to be prefilled again (prompt + outputs so far) when blocks free up.

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
from torpor.engine.outputs import FinishReason, TokenLogprobs
from torpor.engine.sequence import Sequence, SequenceStatus


def _arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler:
    """Owns the waiting queue, the running batch and the KV block allocator."""

    def __init__(self, config: EngineConfig, eos_token_ids: Iterable[int] = ()):
        if config.num_kv_blocks is None:
            raise ValueError("config.num_kv_blocks is not set: profile memory and use "
                             "config.with_num_kv_blocks(n) before building the scheduler")
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []           # sorted by arrival, oldest first
        self.paused = False
        self.draining = False  # admit no new prefills; running sequences go on (before a sleep)
        self._requests: dict[str, Sequence] = {}    # unfinished sequences by request id
        self._arrivals = itertools.count()
        # Seeds of unseeded requests, drawn in arrival order: an engine run is reproducible
        # from config.seed alone.
        self._seed_rng = random.Random(config.seed)

    # --- requests in and out -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError if it can never be served."""
        if seq.request_id in self._requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.num_output_tokens or seq.block_table:
            raise ValueError(f"request {seq.request_id!r} was already scheduled ({seq!r})")
        seq.arrival = next(self._arrivals)
        if seq.sampling_seed is None:
            seq.sampling_seed = self._seed_rng.getrandbits(64)
        self.waiting.append(seq)
        self._requests[seq.request_id] = seq

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End `seq` now (stop string found by the engine, abort, ...) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.deallocate(seq)
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        del self._requests[seq.request_id]

    def abort(self, request_id: str) -> Sequence | None:
        """Finish an unfinished request with reason 'abort'; None if there is no such request."""
        seq = self._requests.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def is_finished(self) -> bool:
        """True when no request waits or runs."""
        return not self._requests

    # --- scheduling ----------------------------------------------------------------------
    def pause(self) -> None:
        """Stop scheduling (sleep level 0): `schedule` returns nothing; requests still queue."""
        self.paused = True

    def drain(self) -> None:
        """Let the running sequences finish but start no new ones (a sleep waits for them)."""
        self.draining = True

    def resume(self) -> None:
        self.paused = self.draining = False

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next batch and whether it is a prefill. Empty when paused or idle."""
        if self.paused:
            return [], False
        seqs = self._schedule_prefill()
        if seqs:
            return seqs, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs and not self.draining:
            seq = self.waiting[0]
            if (num_tokens + seq.num_new_tokens > self.config.max_num_batched_tokens
                    or not self.block_manager.can_allocate(seq)):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            scheduled.append(seq)
            num_tokens += seq.num_new_tokens
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        # Oldest first: a sequence that needs a block takes it from the newest ones.
        scheduled: list[Sequence] = []
        while len(scheduled) < len(self.running):
            seq = self.running[len(scheduled)]
            while not self.block_manager.can_append(seq) and self.running[-1] is not seq:
                self._preempt(self.running.pop())
            if not self.block_manager.can_append(seq):
                # `seq` is the newest left: it yields to the older, already scheduled ones.
                self._preempt(self.running.pop())
                break
            self.block_manager.may_append(seq)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-preemption: drop the KV blocks, requeue at the front."""
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def reset_blocks(self) -> None:
        """Forget all KV-cache contents (the cache was discarded by sleep): running sequences
        are preempted (they recompute later) and the allocator returns to its cold state."""
        while self.running:
            self._preempt(self.running.pop())
        self.block_manager.reset()

    # --- results -------------------------------------------------------------------------
    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list[TokenLogprobs | None] | None = None) -> list[Sequence]:
        """Append each sequence's sampled token and finish those that hit a stop condition
        (eos unless ignore_eos, stop_token_ids, max_tokens, max_model_len). Stop strings need
        text: the engine checks them after detokenizing and calls `finish(seq, "stop", s)`.
        Returns the sequences finished here."""
        if len(token_ids) != len(seqs) or (logprobs is not None and len(logprobs) != len(seqs)):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} tokens / "
                             f"{None if logprobs is None else len(logprobs)} logprobs")
        finished = []
        for i, (seq, token_id) in enumerate(zip(seqs, token_ids, strict=True)):
            if seq.is_finished:  # aborted while its step ran: drop the token
                continue
            seq.append_token(token_id, None if logprobs is None else logprobs[i])
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
