"""KV-cache sizing (a profiling pass on GPU, a byte budget on CPU) and allocation.

Layout: one allocation `[num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]`; each layer's
attention gets the contiguous views `[layer, 0]` and `[layer, 1]`. The last block is a scratch block the
scheduler never hands out: padded rows of CUDA-graph batches write their K/V there.
"""

from __future__ import annotations

import torch
from torch import nn

from torpor.engine import profile_cache
from torpor.engine.attention.metadata import AttentionMetadata
from torpor.engine.config import EngineConfig
from torpor.engine.distributed import tp_rank, tp_size
from torpor.engine.models.config import ModelConfig
from torpor.engine.sampler import Sampler, compute_prompt_logprobs
from torpor.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from torpor.engine.sequence import Sequence

CPU_KV_CACHE_BYTES = 1 << 30   # CPU: at most this much KV cache unless num_kv_blocks is given
PROMPT_LOGPROBS_CHUNK = 512    # prompt positions whose logits exist at once (bounds [chunk, vocab] fp32)
_MIN_GRAPH_RESERVE = 256 << 20  # GPU: kept free for the CUDA-graph pool (decode activations)


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (this rank's kv heads under tensor parallelism)."""
    per_token = 2 * model_config.num_hidden_layers * (model_config.kv_size // tp_size()) * dtype.itemsize
    return block_size * per_token


def allocate_kv_cache(model: nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed cache of `num_blocks` blocks (the scratch block included), bound to the model's layers.
    Zeroed, not empty: the CPU decode path reads whole blocks and masks after the matmul."""
    num_kv_heads = model_config.num_key_value_heads // tp_size()  # this rank's kv heads
    shape = (model_config.num_hidden_layers, 2, num_blocks, block_size, num_kv_heads, model_config.head_dim)
    kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = kv_cache[i, 0], kv_cache[i, 1]
    return kv_cache


def cpu_num_kv_blocks(config: EngineConfig, block_bytes: int) -> int:
    """Blocks for max_num_seqs full-length sequences, capped at CPU_KV_CACHE_BYTES (never below one
    max_model_len sequence)."""
    return max(config.max_num_blocks_per_seq, min(_max_useful_blocks(config), CPU_KV_CACHE_BYTES // block_bytes))


def gpu_num_kv_blocks(config: EngineConfig, model: nn.Module, model_config: ModelConfig, block_bytes: int,
                      reserved_bytes: int, device: torch.device) -> int:
    """Blocks that fit in gpu_memory_utilization of the device once the weights (already loaded), the
    peak of a worst-case step (measured) and `reserved_bytes` (decode workspace, graph buffers) are
    counted, capped at what max_num_seqs sequences of max_model_len tokens can use. The profiling step
    allocates outside every memory tag and leaves nothing behind; a restart with the same model, options,
    code and GPU reads its peak back instead of running it (profile_cache.py)."""
    key = profile_cache.cache_key(config, model_config, device, tp_rank())
    step, cached = profile_cache.step_memory(key, lambda: _measure_step(config, model, model_config, device),
                                             config.kv_profile_cache)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what the allocator caches goes back to the device: counted as free
    free, total = torch.cuda.mem_get_info(device)
    # Read back, the step has not run: the kernel code its first run loads is not in `total - free` yet.
    peak = step.peak_bytes + (step.outside_bytes if cached else 0)
    graph_reserve = 0 if config.enforce_eager else _graph_reserve(config, model_config)
    available = total * config.gpu_memory_utilization - (total - free) - peak - reserved_bytes - graph_reserve
    num_blocks = int(available // block_bytes) - 1  # minus the scratch block
    if num_blocks * config.block_size < config.max_model_len:
        gib = 2**30
        raise ValueError(
            f"no room for a KV cache of max_model_len ({config.max_model_len}) tokens: of "
            f"gpu_memory_utilization={config.gpu_memory_utilization} x {total / gib:.1f} GiB, "
            f"{(total - free) / gib:.2f} GiB are in use (weights, CUDA context, other processes) and a step "
            f"needs {(peak + reserved_bytes + graph_reserve) / gib:.2f} GiB; raise gpu_memory_utilization or "
            f"lower max_model_len / max_num_batched_tokens / max_num_seqs")
    return min(num_blocks, _max_useful_blocks(config))


def _measure_step(config: EngineConfig, model: nn.Module, model_config: ModelConfig,
                  device: torch.device) -> profile_cache.StepMemory:
    """Run a worst-case step (`_profile_step`): its peak in the allocator and what it left on the device
    outside it (kernel code loaded on first use; other processes' changes meanwhile blur this reading)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    _profile_step(config, model, model_config, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()  # the profiling step's memory goes back to the device
    outside = free_before - torch.cuda.mem_get_info(device)[0] - (torch.cuda.memory_allocated(device) - before)
    return profile_cache.StepMemory(peak, max(0, outside))


def _max_useful_blocks(config: EngineConfig) -> int:
    """Every running sequence at max_model_len: without prefix caching, more blocks are never used."""
    return config.max_num_seqs * config.max_num_blocks_per_seq


@torch.inference_mode()
def _profile_step(config: EngineConfig, model: nn.Module, model_config: ModelConfig, device: torch.device) -> None:
    """The largest prefill the scheduler can send (max_num_batched_tokens tokens in max_model_len
    sequences, no KV cache bound yet), one chunk of prompt logprobs, then sampling max_num_seqs rows
    with top-p and the most logprobs (the sampler's sort is its largest temporary)."""
    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    lens = [config.max_model_len] * (num_tokens // config.max_model_len)
    lens += [num_tokens % config.max_model_len] if num_tokens % config.max_model_len else []
    cu_seqlens = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=device),
        cu_seqlens_q=cu_seqlens.to(device),
        max_seqlen_q=max(lens),
        max_context_len=max(lens),
        cu_seqlens_k=cu_seqlens.to(device),
    )
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, metadata)
    chunk = min(PROMPT_LOGPROBS_CHUNK, num_tokens - 1)
    if chunk > 0:
        compute_prompt_logprobs(model.compute_logits(hidden[:chunk]), [0] * (chunk + 1), MAX_LOGPROBS)
    rows = torch.arange(config.max_num_seqs, device=device) % num_tokens
    params = SamplingParams(top_p=0.9, top_k=50, seed=0, logprobs=MAX_LOGPROBS)
    seqs = [Sequence(f"profile-{i}", [0], params) for i in range(config.max_num_seqs)]
    Sampler(config.max_num_seqs, device)(model.compute_logits(hidden[rows]), seqs)


def _graph_reserve(config: EngineConfig, model_config: ModelConfig) -> int:
    """A generous bound on the CUDA-graph pool: a few decode activations of max_num_seqs rows per layer
    (the pool reuses memory across layers and across the graphs, captured largest first)."""
    m = model_config
    row_bytes = 4 * (m.qkv_size + 2 * m.intermediate_size + 4 * m.hidden_size)  # fp32 upper bound
    return max(_MIN_GRAPH_RESERVE, 4 * config.max_num_seqs * row_bytes)
