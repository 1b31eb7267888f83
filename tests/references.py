"""PyTorch references and random inputs for the kernel tests (tests/cpu and tests/gpu) and benchmarks.

The fused-kernel references run the model code's PyTorch path (`RMSNorm._norm`, SiluAndMul's ops,
`apply_rotary`) directly, never the module's `forward`: on CUDA that would dispatch to the fused kernel
under test itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torpor.engine.models.layers.norm import RMSNorm
from torpor.engine.models.layers.rotary import apply_rotary
from torpor.engine.outputs import TokenLogprobs
from torpor.engine.sampler import BatchParams, Sampler, SamplerOutput
from torpor.engine.sequence import Sequence


class _Norm:
    """RMSNorm's own normalization (`_norm`) on given weights, without building a module."""

    _norm = RMSNorm._norm

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), as RMSNorm.forward's PyTorch path."""
    h = x + residual
    return _Norm(weight, eps)._norm(h), h


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x), as RMSNorm.forward's PyTorch path."""
    return _Norm(weight, eps)._norm(x)


def qk_norm_rope_reference(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """qk_norm_rope_ (in place, same arguments) by LlamaAttention.forward's ops: split, view, q_norm/k_norm,
    apply_rotary; the results are copied back into qkv's q and k columns."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = _Norm(q_weight, eps)._norm(q), _Norm(k_weight, eps)._norm(k)
    q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    qkv[:, :q_size] = q.view(num_tokens, q_size)
    qkv[:, q_size : q_size + kv_size] = k.view(num_tokens, kv_size)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, SiluAndMul's PyTorch path: gate_up [N, 2 * I] -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def random_paged_decode_inputs(
    context_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    max_blocks_per_seq: int | None = None,
    poison_unused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random decode inputs laid out as the model runner does, for tests and benchmarks.

    K and V are views of one allocation (equal, non-dense strides); blocks are handed out in shuffled
    order; block tables are padded (to max_blocks_per_seq, default one more than needed) with a spare
    block; q is a slice of a wider projection, so its sequence stride is not dense. With poison_unused,
    cache slots no sequence owns hold NaN, so a kernel that reads past a context length produces NaN.
    Returns q, k_cache, v_cache, block_tables (int32), context_lens (int32).
    """
    gen = torch.Generator(device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen, device=device).int()
    max_blocks_per_seq = max_blocks_per_seq or max(blocks_per_seq) + 1
    if max_blocks_per_seq < max(blocks_per_seq):
        raise ValueError(f"max_blocks_per_seq={max_blocks_per_seq} cannot hold a context of {max(context_lens)}")
    block_tables = order[-1].repeat(len(context_lens), max_blocks_per_seq)
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    first_block = 0
    for seq, (context_len, num_seq_blocks) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        seq_blocks = order[first_block : first_block + num_seq_blocks]
        block_tables[seq, :num_seq_blocks] = seq_blocks
        first_block += num_seq_blocks
        positions = torch.arange(context_len, device=device)
        owned[seq_blocks[positions // block_size].long() * block_size + positions % block_size] = True
    if poison_unused:
        kv.masked_fill_(~owned.view(num_blocks, 1, block_size, 1, 1), float("nan"))
    qkv = torch.randn(
        len(context_lens), num_q_heads + 2 * num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype
    )
    context_lens_t = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return qkv[:, :num_q_heads], kv[:, 0], kv[:, 1], block_tables, context_lens_t


def shared_prefix_decode_inputs(
    groups: list[tuple[int, list[int]]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    shared: bool,
    device: torch.device | str = "cpu",
    seed: int = 0,
    num_padding: int = 0,
    max_group_members: int | None = None,
):
    """Decode inputs of sequences with shared prompt prefixes, as prefix caching lays them out (`shared`:
    the samples of a prompt hold the same prefix blocks) or as it does not (each holds its own copy of the same
    K/V). `groups`: (prefix_len, own lengths of its samples) per prompt; prefix_len a multiple of block_size
    (0: no prefix). `num_padding` rows of context 0 follow (CUDA-graph padding). The same seed gives the same
    queries and K/V values in both layouts. Returns (q, k_cache, v_cache, block_tables, context_lens, prefixes)
    with `prefixes` a triton_decode.DecodePrefixes: the samples of a prompt in groups of at most
    `max_group_members` (default: what the kernel's tile holds) when `shared`, every sequence alone otherwise."""
    from torpor.engine.attention.triton_decode import DecodePrefixes
    from torpor.engine.attention.triton_decode import max_group_members as tile_members

    if max_group_members is None:
        max_group_members = tile_members(num_q_heads, num_kv_heads)
    gen = torch.Generator().manual_seed(seed)
    prefix_values, own_values, tables, prefix_lens, context_lens, members = [], [], [], [], [], []
    shape = (block_size, num_kv_heads, head_dim)
    next_block = 0
    for prefix_len, own_lens in groups:
        num_prefix_blocks = prefix_len // block_size
        values = torch.randn(num_prefix_blocks, 2, *shape, generator=gen)
        base = list(range(next_block, next_block + num_prefix_blocks))
        if shared:
            prefix_values.append((base, values))
            next_block += num_prefix_blocks
        chunk: list[int] = []
        for own in own_lens:
            if not shared:
                base = list(range(next_block, next_block + num_prefix_blocks))
                prefix_values.append((base, values))
                next_block += num_prefix_blocks
            num_own_blocks = -(-own // block_size)
            own_blocks = list(range(next_block, next_block + num_own_blocks))
            next_block += num_own_blocks
            own_values.append((own_blocks, torch.randn(num_own_blocks, 2, *shape, generator=gen)))
            tables.append(base + own_blocks)
            prefix_lens.append(prefix_len)
            context_lens.append(prefix_len + own)
            if shared and prefix_len and len(chunk) < max_group_members:
                chunk.append(len(tables) - 1)
            else:
                if chunk:
                    members.append(chunk)
                chunk = [len(tables) - 1]
        members.append(chunk)
    for _ in range(num_padding):
        tables.append([])
        prefix_lens.append(0)
        context_lens.append(0)
        members.append([len(tables) - 1])
    kv = torch.zeros(next_block + 1, 2, *shape)
    for blocks, values in prefix_values + own_values:
        if blocks:
            kv[torch.tensor(blocks)] = values
    width = max(map(len, tables)) + 1
    block_tables = torch.tensor([t + [next_block] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(tables), num_q_heads, head_dim, generator=gen)
    starts = [0]
    for chunk in members:
        starts.append(starts[-1] + len(chunk))
    starts += [starts[-1]] * (len(tables) + 1 - len(starts))
    as_int = {"dtype": torch.int32, "device": device}
    prefixes = DecodePrefixes(torch.tensor(prefix_lens, **as_int), torch.tensor(starts, **as_int),
                              torch.tensor([i for chunk in members for i in chunk], **as_int))
    kv = kv.to(device=device, dtype=dtype)
    return (q.to(device=device, dtype=dtype), kv[:, 0], kv[:, 1], block_tables.to(device),
            torch.tensor(context_lens, **as_int), prefixes)


# ---------------------------------------------------------------------------------------------------------
# The sampler as it was before the block-sum search (a full-vocabulary int64 cumsum per draw, four host copies for
# logprobs): the reference the new draw and logprobs must equal bit for bit (tests/cpu/test_sampler_exact.py,
# tests/gpu/test_sampler_exact.py, scripts/bench_sampler.py). Copied verbatim; only names changed. The call
# itself is `Sampler`'s (that change left its frame alone): the old draw comes in through `_sample`, the old
# logprobs through `_with_logprobs`.


_PROB_SCALE = 2.0**36  # the old sampler's constants, kept here so that a change of the sampler's cannot hide
_HALF_BITS = 26


class ReferenceSampler(Sampler):
    """`Sampler` with the draw and logprobs of the old implementation (its inputs, logits processing and
    batch facts are the current ones, which that change left alone)."""

    def _with_logprobs(self, raw_logits: torch.Tensor, token_ids: torch.Tensor, batch: BatchParams) -> SamplerOutput:
        """The old implementation's logprobs of each requesting row (`logprob_dicts_reference`)."""
        logprob_rows, num_seqs = batch.logprob_rows, raw_logits.shape[0]
        num_top = [batch.params[i].logprobs for i in logprob_rows]
        if len(logprob_rows) == num_seqs:
            dicts = logprob_dicts_reference(raw_logits, token_ids, num_top)
        else:
            rows = torch.tensor(logprob_rows).to(raw_logits.device, non_blocking=True)
            dicts = logprob_dicts_reference(raw_logits.index_select(0, rows), token_ids.index_select(0, rows), num_top)
        logprobs: list[TokenLogprobs | None] = [None] * num_seqs
        for i, d in zip(logprob_rows, dicts, strict=True):
            logprobs[i] = d
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], batch: BatchParams) -> torch.Tensor:
        """Temperature, min_p, top-k, top-p, then an inverse-CDF draw; [num_seqs] int64 token ids."""
        inputs = self._load_inputs(seqs, batch)
        use_min_p, filters = batch.use_min_p, batch.filters
        if all(filters) or not any(filters):
            return self._draw(logits, inputs, filters[0], use_min_p)
        # A row's draw must not depend on its neighbours: rows that filter walk the vocabulary sorted by
        # probability, the others in id order (the same random number picks another token), so the two
        # groups are drawn apart.
        picked = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        for needs_filter in (False, True):
            rows = [i for i, f in enumerate(filters) if f == needs_filter]
            index = torch.tensor(rows).to(logits.device, non_blocking=True)
            group = self._draw(logits.index_select(0, index), inputs.index_select(1, index), needs_filter, use_min_p)
            picked.index_copy_(0, index, group)
        return picked

    @staticmethod
    def _draw(logits: torch.Tensor, inputs: torch.Tensor, needs_filter: bool, use_min_p: bool) -> torch.Tensor:
        """The draw of `_sample` for rows that all filter (top-k/top-p: sorted vocabulary) or none do."""
        vocab_size = logits.shape[1]
        temperature = inputs[0].float()
        probs = torch.softmax(logits / temperature[:, None], dim=-1)       # [num_seqs, vocab]
        if use_min_p:
            # min_p: drop tokens below min_p times the row's most likely one (rows with 0 keep all).
            min_p = inputs[4].float()
            probs.masked_fill_(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        if needs_filter:
            # Stable sort: ties keep token-id order, so top-p cuts are deterministic.
            probs, order = probs.sort(dim=-1, descending=True, stable=True)
            # top-k keeps every token as likely as the k-th: tokens of equal logits (common in bf16) are
            # kept or dropped together, not told apart by their ids (vLLM, transformers).
            kth = probs.gather(1, inputs[2].long()[:, None] - 1)
            probs.masked_fill_(probs < kth, 0.0)
        # Exact fixed-point weights: scaling by a power of two, then truncation.
        weights = probs.mul_(_PROB_SCALE).long()  # [num_seqs, vocab]
        del probs
        if needs_filter:
            top_p = inputs[1]
            cdf = weights.cumsum(dim=-1)
            # Nucleus: keep tokens whose preceding mass is below top_p of the (top-k) total;
            # exclusive < x  <=>  exclusive < ceil(x) for integers, so this stays exact.
            threshold = torch.ceil(top_p * cdf[:, -1].double()).long()
            weights.masked_fill_(cdf - weights >= threshold[:, None], 0)
        cdf = weights.cumsum(dim=-1)                                        # exact int64
        # target = floor(total * bits / 2^52) < total, so the first cdf entry above it is a token with
        # positive weight; in two 26-bit halves (floor of floors is exact), each product below 2^63.
        total, bits = cdf[:, -1], inputs[3].long()
        high, low = bits >> _HALF_BITS, bits & ((1 << _HALF_BITS) - 1)
        target = (total * high + ((total * low) >> _HALF_BITS)) >> _HALF_BITS  # [num_seqs]
        picked = torch.searchsorted(cdf, target[:, None], right=True)       # [num_seqs, 1]
        picked.clamp_(max=vocab_size - 1)  # only NaN logits could push it past the end
        if needs_filter:
            picked = order.gather(1, picked)
        return picked.squeeze(1)


def logprob_dicts_reference(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """The sampler's `_logprob_dicts` before the single host copy (four host copies), verbatim."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                   # [rows, vocab]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)             # [rows]
    max_top = max(num_top)
    top_ids_host: list[list[int]] = [[] for _ in num_top]
    top_values_host: list[list[float]] = [[] for _ in num_top]
    if max_top:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [rows, max_top], sorted
        top_ids_host, top_values_host = top_ids.tolist(), top_values.tolist()
    chosen_ids, chosen_lp = token_ids.tolist(), chosen.tolist()
    dicts = []
    for i, k in enumerate(num_top):
        d = {chosen_ids[i]: chosen_lp[i]}
        d.update(zip(top_ids_host[i][:k], top_values_host[i][:k], strict=True))
        dicts.append(d)
    return dicts


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V, computed in fp32.

    q: [num_seqs, num_q_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks_per_seq]; context_lens: [num_seqs].
    Returns fp32 [num_seqs, num_q_heads, head_dim]; a sequence with context length 0 gets zeros.
    Reads context_lens on the host, so it is for tests and CPU use, not CUDA graphs.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        positions = torch.arange(context_len, device=q.device)
        blocks = block_tables[seq].long()[positions // block_size]
        offsets = positions % block_size
        # [context_len, num_kv_heads, head_dim] -> one kv head per group of q heads
        keys = k_cache[blocks, offsets].float().repeat_interleave(queries_per_kv, dim=1)
        values = v_cache[blocks, offsets].float().repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("hd,thd->ht", q[seq].float(), keys) * scale  # [num_q_heads, context_len]
        out[seq] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), values)
    return out
