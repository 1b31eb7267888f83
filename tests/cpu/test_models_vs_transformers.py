"""torpor's decoder (CPU attention backend, paged KV cache) against Hugging Face transformers, fp32."""

import pytest
import torch
import transformers

from torpor.engine.attention.metadata import AttentionMetadata
from torpor.engine.attention.torch_backend import TorchAttentionBackend
from torpor.engine.models import ModelConfig, build_model
from torpor.engine.models.layers.rotary import compute_inv_freq
from torpor.engine.weights.loader import load_weights
from torpor.synthetic import make_model

ARCHS = {"tiny": "Qwen3ForCausalLM", "tiny-llama": "LlamaForCausalLM", "tiny-qwen2": "Qwen2ForCausalLM",
         "tiny-moe": "Qwen3MoeForCausalLM"}
BLOCK_SIZE = 4
NUM_BLOCKS = 48
ATOL = 1e-4  # logits are O(1); fp32 differences are ~1e-6


class PagedKV:
    """A hand-built paged KV cache: per-layer views of one allocation, fixed per-sequence block tables."""

    def __init__(self, model, config: ModelConfig, block_tables: list[list[int]]) -> None:
        shape = (config.num_hidden_layers, 2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        self.kv = torch.zeros(shape)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = self.kv[i, 0], self.kv[i, 1]
        self.model, self.block_tables = model, block_tables
        self.lens = [0] * len(block_tables)

    def step(self, batch: dict[int, list[int]], is_prefill: bool) -> torch.Tensor:
        """Run the new tokens of the sequences in `batch` (sequence index -> new tokens), packed;
        returns float32 logits [num_tokens, vocab]."""
        positions, slots = [], []
        for seq, tokens in batch.items():
            for pos in range(self.lens[seq], self.lens[seq] + len(tokens)):
                positions.append(pos)
                slots.append(self.block_tables[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            self.lens[seq] += len(tokens)
        tables = [self.block_tables[seq] for seq in batch]
        width = max(len(t) for t in tables)
        query_lens = torch.tensor([len(t) for t in batch.values()], dtype=torch.int32)
        context_lens = [self.lens[seq] for seq in batch]
        metadata = AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0, dtype=torch.int32)]),
            max_seqlen_q=int(query_lens.max()),
            max_context_len=max(context_lens),
        )
        input_ids = torch.tensor([t for tokens in batch.values() for t in tokens])
        with torch.inference_mode():
            return self.model.compute_logits(self.model(input_ids, torch.tensor(positions), metadata))


@pytest.fixture(scope="module", params=list(ARCHS))
def models(request, tmp_path_factory):
    path = make_model(request.param, tmp_path_factory.mktemp(request.param), dtype="float32", progress=False)
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == ARCHS[request.param]
    ours = build_model(config, TorchAttentionBackend(), dtype=torch.float32)
    load_weights(ours, path)
    hf_class = getattr(transformers, config.architecture)
    reference = hf_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, reference, config


def reference_logits(reference, tokens: list[int], offset: int = 0) -> torch.Tensor:
    with torch.inference_mode():
        position_ids = torch.arange(offset, offset + len(tokens))[None]
        return reference(torch.tensor([tokens]), position_ids=position_ids).logits[0].float()


def random_tokens(config: ModelConfig, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def test_prefill_then_paged_decode(models):
    ours, reference, config = models
    prompts = random_tokens(config, [7, 13, 2], seed=1)
    # Non-contiguous, interleaved block tables; block 0 is real for seq 1 and the padding of the others.
    kv = PagedKV(ours, config, [[31, 2, 17, 8, 25], [4, 30, 11, 22, 0], [13, 6, 27]])
    logits = kv.step(dict(enumerate(prompts)), is_prefill=True)
    for (start, end), prompt in zip([(0, 7), (7, 20), (20, 22)], prompts, strict=True):
        torch.testing.assert_close(logits[start:end], reference_logits(reference, prompt), atol=ATOL, rtol=0)
    sequences = [list(p) for p in prompts]
    for step, next_tokens in enumerate(random_tokens(config, [3] * 4, seed=2)):
        for seq, token in zip(sequences, next_tokens, strict=True):
            seq.append(token)
        logits = kv.step({i: [t] for i, t in enumerate(next_tokens)}, is_prefill=False)
        assert logits.shape == (3, config.vocab_size)
        for i, seq in enumerate(sequences):
            expected = reference_logits(reference, seq)[-1]
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0, msg=f"decode step {step}, seq {i}")


def test_prefill_over_cached_prefix(models):
    """A second prefill chunk attends to the prefix already in the cache (next to a fresh sequence)."""
    ours, reference, config = models
    first, second, other = random_tokens(config, [6, 5, 9], seed=3)
    kv = PagedKV(ours, config, [[9, 40, 3], [21, 14, 33]])
    kv.step({0: first}, is_prefill=True)
    logits = kv.step({0: second, 1: other}, is_prefill=True)
    torch.testing.assert_close(logits[:5], reference_logits(reference, first + second)[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[5:], reference_logits(reference, other), atol=ATOL, rtol=0)


def test_positions_far_from_zero(models):
    """RoPE at large positions (where Llama 3.1 frequency scaling matters), no KV cache attached."""
    ours, reference, config = models
    (tokens,) = random_tokens(config, [5], seed=4)
    offset = 3000
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.arange(5),
        context_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
        max_seqlen_q=5,
        max_context_len=5,
    )
    fresh = build_model(config, TorchAttentionBackend(), dtype=torch.float32)
    fresh.load_state_dict(ours.state_dict())
    with torch.inference_mode():
        logits = fresh.compute_logits(fresh(torch.tensor(tokens), torch.arange(offset, offset + 5), metadata))
    torch.testing.assert_close(logits, reference_logits(reference, tokens, offset), atol=ATOL, rtol=0)


def test_llama3_rope_scaling_is_exact(models):
    _, reference, config = models
    if config.rope_scaling is None:
        pytest.skip("no rope_scaling in this architecture")
    ours_inv_freq = compute_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(ours_inv_freq, reference.model.rotary_emb.inv_freq)
    # the scaling really changes the frequencies (low and medium bands), so the checks above bite
    unscaled = compute_inv_freq(config.head_dim, config.rope_theta, None)
    assert (ours_inv_freq != unscaled).sum() >= 2
