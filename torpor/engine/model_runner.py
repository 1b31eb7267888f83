"""Owns the model, the KV cache and every other device buffer; runs one scheduled batch per call.

Every kernel runs on the engine's own stream (engine_stream.py). Start-up happens in phases, each
inside its memory tag (`memory.tag(...)`, or no scope without a MemoryManager), so every persistent
buffer lands where sleep mode expects it:

    workspace    GPU: the stream's GEMM workspace (cuBLASLt, gemm.py)
    weights      build_model (parameters and the RoPE table)
    (no tag)     load_weights (the staged loader, weights/staging.py) into those parameters, on a thread of
                 its own beside the two phases below (weights/background_load.py)
    (no tag)     GPU: a profiling step sizes the KV cache; it leaves nothing behind
    runtime      the decode buffers, the sampler's state (incl. the penalties' token history), nested in it:
      kv_cache   the KV cache
    workspace    MoE: the routed-experts buffer (routing_recorder.py); GPU: the Triton decode workspace
    cuda_graph   GPU: the pool of the decode CUDA graphs

Steps allocate only temporaries, outside every tag (the engine's sleep empties PyTorch's cache of them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator

import torch

from torpor.engine.attention.torch_backend import TorchAttentionBackend
from torpor.engine.config import EngineConfig
from torpor.engine.cuda_graphs import CudaGraphRunner, run_decode
from torpor.engine.distributed import current, tp_size
from torpor.engine.engine_stream import EngineStream
from torpor.engine.gemm import row_invariant
from torpor.engine.inputs import DecodeBuffers, prepare_prefill
from torpor.engine.kv_cache import (
    PROMPT_LOGPROBS_CHUNK,
    allocate_kv_cache,
    cpu_num_kv_blocks,
    gpu_num_kv_blocks,
    kv_block_bytes,
)
from torpor.engine.lazy_jit import warm_triton_cache_key
from torpor.engine.models import ModelConfig, build_model
from torpor.engine.models.config import DTYPES
from torpor.engine.phase_times import phase
from torpor.engine.routing_recorder import RoutingRecorder
from torpor.engine.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from torpor.engine.sequence import Sequence
from torpor.engine.weights.background_load import BackgroundLoad
from torpor.engine.weights.dummy import init_dummy_weights
from torpor.engine.weights.index import checkpoint_bytes
from torpor.engine.weights.loader import check_update, load_named_tensors, load_weights
from torpor.engine.weights.staging import StagingBuffers
from torpor.env import Env
from torpor.lazy import collector_paused

logger = logging.getLogger("torpor.engine")


def debug_logging() -> None:
    """With TORPOR_DEBUG=1, print `torpor.engine`'s debug lines (start-up phases, loads) on stderr."""
    if Env.read().debug and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s torpor.engine %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)


@contextlib.contextmanager
def timed_phase(name: str) -> Iterator[None]:
    """One start-up phase: its seconds in the start-up's record (`LLM.startup_phases`) and, at debug level, on
    `torpor.engine`."""
    start = time.perf_counter()
    with phase(name):
        yield
    logger.debug("start-up phase %s: %.3f s", name, time.perf_counter() - start)


class ModelRunner:
    """`config.device` must be resolved ("cpu" or "cuda:N"). After construction `self.config` holds the
    number of KV blocks the scheduler may hand out (the scratch block excluded)."""

    @collector_paused()  # start-up: no full garbage collections over torch's objects (torpor/lazy.py)
    def __init__(self, config: EngineConfig, memory=None) -> None:
        debug_logging()
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            with timed_phase("cuda_init"):
                torch.cuda.set_device(self.device)  # creates the context (PyTorch's lazy init)
        if memory is not None and memory.device != self.device:
            raise ValueError(f"the MemoryManager is on {memory.device}, the engine on {self.device}")
        if tp_size() != config.tensor_parallel_size:
            raise RuntimeError(f"the active tensor-parallel group has {tp_size()} ranks, the engine wants "
                               f"{config.tensor_parallel_size} (build a ModelRunner through a Worker)")
        self.memory = memory
        self.config = config  # until profiling fills in the number of KV blocks
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.dtype = self.model_config.torch_dtype if config.dtype == "auto" else DTYPES[config.dtype]
        self.engine_stream = EngineStream(self.device)
        # Host buffers of the staged loader, reused by every reload (pinned on CUDA; see weights/staging.py),
        # pinned while the memory manager's tags and the model are built.
        self.staging = StagingBuffers(self.device, threads=config.load_threads or None)
        self.staging.prefetch(checkpoint_bytes(config.model))
        # The stream and its GEMM workspace are given up when the runner goes (see EngineStream.close).
        self._finalizer = weakref.finalize(self, self.engine_stream.close)
        self._finalizer.atexit = False  # no CUDA calls while the interpreter shuts down
        with self.engine_stream.scope():
            self._start(config)

    def _start(self, config: EngineConfig) -> None:
        on_gpu = self.device.type == "cuda"
        self._triton_key: threading.Thread | None = None
        with timed_phase("attention_backend"):  # GPU: imports triton (the decode kernel's)
            if on_gpu:
                from torpor.engine.attention.triton_backend import TritonAttentionBackend  # triton: CUDA only

                self.backend = TritonAttentionBackend()
                self._triton_key = warm_triton_cache_key()  # hashed beside the model build and the weight load
            else:
                self.backend = TorchAttentionBackend()
        if on_gpu:
            with self._tag("workspace"):
                self.engine_stream.make_gemm_workspace(use_torch=config.gemm == "torch")
        with self._tag("weights"), timed_phase("model_build"):
            self.model = build_model(self.model_config, self.backend, self.dtype, self.device, config.max_model_len)
        self.graphs: CudaGraphRunner | None = None
        # On GPU every decode batch is padded to its graph bucket, eager or not: the same shapes give the
        # same kernels (the decode kernel's split count depends on the batch size), so graphs == eager.
        self.pad_decode_batches = on_gpu
        if config.load_format == "dummy":  # no checkpoint: drawn in place (weights/dummy.py)
            with timed_phase("weight_init"):
                init_dummy_weights(self.model, config.seed)
            self._size_and_allocate(config, capture_error_mode="global")
        else:
            self._start_beside_load(config)
        if on_gpu:
            torch.cuda.empty_cache()  # start-up temporaries (default pool) go back to the device

    def _start_beside_load(self, config: EngineConfig) -> None:
        """The weights copied on a thread of their own while the KV cache is sized and the graphs captured
        (neither reads the weights' values: background_load.py); the finite check once they are in."""
        load_stream = EngineStream(self.device)  # no GEMM workspace: copies only
        try:
            with timed_phase("weight_load_plan"):  # every header checked before any byte is written
                load = BackgroundLoad(self.model, config.model, self.staging, load_stream.stream)
            try:
                # The load's thread waits for events while the graphs are captured.
                self._size_and_allocate(config, capture_error_mode="thread_local")
            except BaseException:
                load.abandon()
                raise
            with timed_phase("weight_load_wait"):
                load.finish()
        finally:
            load_stream.close()

    def _size_and_allocate(self, config: EngineConfig, capture_error_mode: str) -> None:
        if self._triton_key is not None:  # before the first launch (the KV sizing's or the first warm-up's)
            self._triton_key.join()
            self._triton_key = None
        # Under tensor parallelism every rank must hold the blocks the scheduler (on rank 0) hands out.
        with timed_phase("kv_cache_sizing"):
            self.config = config.with_num_kv_blocks(current().min(self._num_kv_blocks(config)))
        self._allocate_runtime(capture_error_mode)

    def close(self) -> None:
        """Free the graphs and the GEMM workspace, give up the engine's stream (kept for the next engine; also done
        when the runner is collected), and let go of the weights, the KV cache and the runtime state, so that their
        memory goes back now, not when the runner is collected. The runner cannot run afterwards."""
        self.graphs = None
        self.staging.close()
        self._finalizer()
        self.model = self.kv_cache = self.buffers = self.sampler = self.routing = self._sampled_rows = None
        self.backend = None  # (with the decode workspace)

    def _tag(self, name: str) -> contextlib.AbstractContextManager:
        if self.memory is None:
            return contextlib.nullcontext()
        return self.memory.tag(name)

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        block_bytes = kv_block_bytes(self.model_config, config.block_size, self.dtype)
        if self.device.type == "cpu":
            return cpu_num_kv_blocks(config, block_bytes)
        return gpu_num_kv_blocks(config, self.model, self.model_config, block_bytes, self._reserved_bytes(config),
                                 self.device)

    def _reserved_bytes(self, config: EngineConfig) -> int:
        """Device memory allocated after the KV cache besides the graph pool: decode buffers, workspace."""
        buffers = config.max_num_seqs * (3 * 8 + 4 * (4 + config.max_num_blocks_per_seq)
                                         + self.model_config.hidden_size * self.dtype.itemsize) + 4
        sampler = Sampler.state_bytes(config.max_num_seqs, config.max_model_len)
        routing = RoutingRecorder.nbytes(self.model_config, self._routing_rows(config))
        return buffers + sampler + routing + 4 * self._workspace_numel(config)

    @staticmethod
    def _routing_rows(config: EngineConfig) -> int:
        """Rows of the largest forward: a prefill's tokens, a decode batch's (padded) rows."""
        return max(config.max_num_batched_tokens, config.max_num_seqs)

    def _workspace_numel(self, config: EngineConfig) -> int:
        from torpor.engine.attention.triton_decode import decode_workspace_shape  # imports triton: CUDA only

        m = self.model_config
        return decode_workspace_shape(config.max_num_seqs, m.num_attention_heads // tp_size(),
                                      m.num_key_value_heads // tp_size(), m.head_dim,
                                      config.max_num_blocks_per_seq, config.block_size, self.device,
                                      prefixes=self._decode_group_size() > 0)[0]

    def _decode_group_size(self) -> int:
        """DecodeBuffers' max_group_members: the GPU kernel's group size, 0 on CPU (no shared prefixes)."""
        if self.device.type != "cuda":
            return 0
        m = self.model_config
        return self.backend.decode_group_size(m.num_attention_heads // tp_size(), m.num_key_value_heads // tp_size())

    def _allocate_runtime(self, capture_error_mode: str) -> None:
        config, m = self.config, self.model_config
        num_blocks = config.num_kv_blocks + 1  # + the scratch block, id num_kv_blocks
        with self._tag("runtime"):
            with self._tag("kv_cache"), timed_phase("kv_cache_allocation"):
                self.kv_cache = allocate_kv_cache(self.model, m, num_blocks, config.block_size, self.dtype,
                                                  self.device)
            self.buffers = DecodeBuffers(config.max_num_seqs, config.max_num_blocks_per_seq, m.hidden_size,
                                         self.dtype, self.device, config.block_size, config.num_kv_blocks,
                                         self._decode_group_size())
            self.sampler = Sampler(config.max_num_seqs, self.device, config.max_model_len, m.eos_token_ids)
        self.routing: RoutingRecorder | None = None  # MoE: the experts each forward chose, before the graphs
        self._sampled_rows: torch.Tensor | None = None  # the last forward's row of each sequence (None: row i)
        if m.is_moe:
            with self._tag("workspace"):
                self.routing = RoutingRecorder(self.model, m, self._routing_rows(config), self.device)
        if self.device.type == "cuda":
            from torpor.engine.attention.triton_decode import alloc_decode_workspace  # imports triton: CUDA only

            with self._tag("workspace"):
                self.backend.workspace = alloc_decode_workspace(
                    config.max_num_seqs, m.num_attention_heads // tp_size(), m.num_key_value_heads // tp_size(),
                    m.head_dim, config.max_num_blocks_per_seq, config.block_size, self.device,
                    prefixes=self._decode_group_size() > 0)
            if not config.enforce_eager:
                with torch.inference_mode(), timed_phase("cuda_graph_capture"):
                    self.graphs = CudaGraphRunner(self.model, self.buffers, config.cuda_graph_batch_sizes,
                                                  config.max_model_len, self.memory, capture_error_mode)

    # ---- weights -----------------------------------------------------------------------------
    def reload_weights(self, path: str) -> None:
        """The checkpoint at `path` into the existing parameters (same addresses: graphs stay valid), by
        the staged loader. Every header is checked first: a bad checkpoint raises CheckpointError and
        leaves the weights as they were; a failure after writing began raises CheckpointError with
        `weights_written` (the caller treats the weights as a mix). With `load_format="dummy"` the model folder's
        weights are drawn again: the same values as at start-up."""
        with self.engine_stream.scope():
            if self.config.load_format == "dummy" and path == self.config.model:
                init_dummy_weights(self.model, self.config.seed)
            else:
                load_weights(self.model, path, self.staging)

    def update_weights(self, named_tensors, strict: bool, reset_buffers: bool = True,
                       staged: bool = False) -> int:
        """Hugging Face-named tensors into the existing parameters; recomputes the RoPE table unless
        `reset_buffers` is False (the caller knows the table is intact, or recomputes it once at the end of
        a push in buckets: `reset_buffers()`). A list or tuple is validated whole (names, shapes, dtypes,
        finite values) before anything is written; a stream (any other iterable) is checked tensor by
        tensor, so a bad one midway leaves a mix (CheckpointError with `weights_written`). `staged`: see
        `loader.check_update` (a list checked by `loader.check_staged` already)."""
        with self.engine_stream.scope():
            whole = isinstance(named_tensors, list | tuple)
            if whole:
                check_update(self.model, named_tensors, strict, staged)
            with phase("copy"):
                count = load_named_tensors(self.model, named_tensors, strict=strict, values_checked=whole)
            if reset_buffers:
                self.reset_buffers()
        return count

    def reset_buffers(self) -> None:
        """Recompute the buffers no checkpoint holds (the RoPE table) in place: after the weights' memory
        was discarded (level-2 sleep) they are zero like the weights."""
        with self.engine_stream.scope(), phase("buffers"):
            self.model.reset_buffers()

    def check_update(self, named_tensors, strict: bool, staged: bool = False) -> None:
        """Validate a whole update (a list) against this rank's model without writing anything."""
        check_update(self.model, named_tensors, strict, staged)

    # ---- steps -----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        """Run one scheduled batch and sample the next token of each sequence. A prefill also fills
        `seq.prompt_logprobs` of the sequences that asked for them (once, at their first prefill)."""
        with self.engine_stream.scope():
            output = self.sampler(self._compute_logits(seqs, is_prefill), seqs)
            if self.routing is not None:  # MoE: the routed experts of the sequences that asked
                output.routed_experts = self.routing.collect(seqs, self._sampled_rows)
            return output

    def compute_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """The batch's forward pass up to the logits [num_seqs, vocab_size] (what tensor-parallel
        workers run; call under inference mode)."""
        with self.engine_stream.scope():
            return self._compute_logits(seqs, is_prefill)

    def _compute_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        if not is_prefill:
            return self._decode(seqs)
        with row_invariant():  # a prompt's bits must not depend on its batch: prefix caching changes no answer
            return self._prefill(seqs)

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Computes the sequences that are not `shares_prefill`; a forked sample (right after the sample it
        was forked from) gets that sample's logits row, its prompt logprobs and a copy of its last block."""
        computed = [seq for seq in seqs if not seq.shares_prefill]
        batch = prepare_prefill(computed, self.config.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.metadata)  # [num_tokens, hidden_size]
        for seq, start in zip(computed, batch.starts, strict=True):
            if seq.sampling_params.prompt_logprobs is not None and seq.prompt_logprobs is None:
                self._prompt_logprobs(seq, hidden, start)
        logits = self.model.compute_logits(hidden[batch.last_indices])  # [len(computed), vocab]
        self._sampled_rows = batch.last_indices
        if len(computed) == len(seqs):
            return logits
        rows, row = [], -1  # the logits row of each of `seqs`
        for seq in seqs:
            if not seq.shares_prefill:
                row, parent = row + 1, seq
            elif row < 0:
                raise RuntimeError(f"{seq.seq_id} shares the prefill of no sequence before it")
            elif seq.prompt_logprobs is None:
                seq.prompt_logprobs = parent.prompt_logprobs
            rows.append(row)
        self._copy_blocks([seq.fork_copy for seq in seqs if seq.fork_copy is not None])
        rows = torch.tensor(rows, device=logits.device)
        self._sampled_rows = batch.last_indices[rows]
        return logits[rows]

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """KV blocks copied source -> destination in every layer (the forked samples' last prompt blocks)."""
        if pairs:
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*pairs, strict=True))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [layers, k/v, blocks, block_size, heads, dim]

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int) -> None:
        """Logprobs of prompt tokens 1.. from the hidden states at positions 0.., PROMPT_LOGPROBS_CHUNK
        positions at a time (full [prompt_len, vocab] logits can be gigabytes)."""
        if seq.num_cached_tokens:
            raise RuntimeError(f"{seq.request_id!r}: prompt logprobs need the whole prompt in one prefill")
        num_top, prompt = seq.sampling_params.prompt_logprobs, seq.prompt_token_ids
        result = [None]
        for first in range(0, len(prompt) - 1, PROMPT_LOGPROBS_CHUNK):
            last = min(first + PROMPT_LOGPROBS_CHUNK, len(prompt) - 1)
            logits = self.model.compute_logits(hidden[start + first : start + last])
            result += compute_prompt_logprobs(logits, prompt[first : last + 1], num_top)[1:]
        seq.prompt_logprobs = result

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        num_seqs = len(seqs)
        batch_size = self.config.padded_batch_size(num_seqs) if self.pad_decode_batches else num_seqs
        max_context_len = self.buffers.load(seqs, batch_size)
        self._sampled_rows = None
        if self.graphs is not None:
            hidden = self.graphs.replay(self.buffers, batch_size)
        else:
            hidden = run_decode(self.model, self.buffers, batch_size, max_context_len)
        return self.model.compute_logits(hidden[:num_seqs])
