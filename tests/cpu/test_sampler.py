import bisect
import itertools
import math

import pytest
import torch

from torpor.engine.sampler import Sampler, compute_prompt_logprobs, random_bits, random_bits_batch
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.sequence import Sequence

VOCAB = 64


def make_seq(request_id="r", seed=0, **params) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(seed=seed, **params))


def random_logits(num_seqs, seed=0, scale=3.0):
    return torch.randn(num_seqs, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def sample_steps(sampler, seqs, logits_for_step, num_steps):
    """Run `num_steps` sampling steps, appending each token; returns per-seq token lists."""
    for step in range(num_steps):
        out = sampler(logits_for_step(step), seqs)
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.append_token(token)
    return [s.output_token_ids for s in seqs]


def test_greedy_is_argmax_with_first_index_on_ties():
    logits = random_logits(5)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1.0
    seqs = [make_seq(str(i), temperature=0.0) for i in range(5)]
    out = Sampler(8)(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist() and out.token_ids[2] == 7
    assert out.logprobs == [None] * 5


def test_seeded_sampling_is_independent_of_the_batch():
    target = dict(temperature=0.8, top_p=0.95, seed=1234)
    alone = sample_steps(Sampler(8), [make_seq("t", **target)], lambda s: random_logits(1, s), 12)[0]
    crowd = [make_seq("g", temperature=0.0), make_seq("t", **target), make_seq("k", top_k=3, seed=5)]

    def crowd_logits(step):  # the target row is the same; the neighbours get other logits
        other = random_logits(3, 1000 + step)
        other[1] = random_logits(1, step)[0]
        return other

    assert sample_steps(Sampler(8), crowd, crowd_logits, 12)[1] == alone
    assert len(set(alone)) > 1                                  # it really sampled


def test_different_seeds_give_different_tokens():
    seqs = [make_seq(str(i), seed=i) for i in range(4)]
    logits = random_logits(1, scale=0.5).expand(4, VOCAB).contiguous()   # same distribution
    tokens = sample_steps(Sampler(8), seqs, lambda s: logits, 10)
    assert len({tuple(t) for t in tokens}) == 4


def test_random_bits_is_a_function_of_seed_and_step():
    assert random_bits(3, 0) == random_bits(3, 0)
    assert len({random_bits(3, s) for s in range(100)}) == 100
    assert all(0 <= random_bits(-1, s) < 2**52 for s in range(10))
    seeds = [0, 1, -1, 2**63, 2**64 - 1, 12345678901234567890, -(2**63)] * 3
    steps = list(range(len(seeds)))
    assert random_bits_batch(seeds, steps) == [random_bits(a, b) for a, b in zip(seeds, steps, strict=True)]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)])
def test_degenerate_filters_equal_greedy(params):
    logits = random_logits(32, seed=3)
    seqs = [make_seq(str(i), seed=i, temperature=1.5, **params) for i in range(32)]
    assert Sampler(32)(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_tokens_inside_their_sets():
    logits = random_logits(1, seed=4, scale=1.0).expand(256, VOCAB).contiguous()
    top5 = set(logits[0].topk(5).indices.tolist())
    probs, order = torch.softmax(logits[0], -1).sort(descending=True)
    nucleus = set(order[:int((probs.cumsum(0) < 0.5).sum()) + 1].tolist())
    sampler = Sampler(256)
    k_tokens = sampler(logits, [make_seq(str(i), seed=i, top_k=5) for i in range(256)]).token_ids
    p_tokens = sampler(logits, [make_seq(str(i), seed=i, top_p=0.5) for i in range(256)]).token_ids
    assert set(k_tokens) == top5 and set(p_tokens) == nucleus


def test_samples_follow_the_tempered_distribution():
    logits = random_logits(1, seed=5, scale=1.0)[:, :8]
    expected = torch.softmax(logits[0] / 0.7, -1)
    seqs = [make_seq(str(i), seed=i, temperature=0.7) for i in range(256)]
    tokens = sample_steps(Sampler(256), seqs, lambda s: logits.expand(256, 8).contiguous(), 16)
    counts = torch.bincount(torch.tensor(tokens).flatten(), minlength=8).double()
    total_variation = 0.5 * (counts / counts.sum() - expected.double()).abs().sum().item()
    assert total_variation < 0.03                                  # 4096 draws, 8 tokens


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = random_logits(3, seed=6)
    seqs = [make_seq("a", temperature=0.0, logprobs=4), make_seq("b", temperature=2.0, logprobs=0),
            make_seq("c", top_k=2)]
    out = Sampler(4)(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    top = ref[0].topk(4)
    assert list(out.logprobs[0].items()) == list(zip(top.indices.tolist(), top.values.tolist(),
                                                     strict=True))   # chosen = argmax = rank 0
    assert out.logprobs[1] == {out.token_ids[1]: ref[1, out.token_ids[1]].item()}
    assert out.logprobs[2] is None


def test_prompt_logprobs():
    prompt = [5, 9, 2, 2, 40]
    logits = random_logits(4, seed=7)
    result = compute_prompt_logprobs(logits, prompt, num_top=2)
    ref = torch.log_softmax(logits, -1)
    assert result[0] is None and len(result) == 5
    for pos in range(4):
        entry = result[pos + 1]
        assert entry[prompt[pos + 1]] == ref[pos, prompt[pos + 1]].item()
        assert set(ref[pos].topk(2).indices.tolist()) <= set(entry) and len(entry) <= 3
    with pytest.raises(ValueError, match="needs logits"):
        compute_prompt_logprobs(logits, prompt[:3], num_top=2)


def test_bad_inputs():
    sampler = Sampler(2)
    with pytest.raises(ValueError, match="float32"):
        sampler(random_logits(1).half(), [make_seq()])
    with pytest.raises(ValueError, match="float32"):
        sampler(random_logits(2), [make_seq()])
    with pytest.raises(ValueError, match="max_num_seqs"):
        sampler(random_logits(3), [make_seq(str(i)) for i in range(3)])
    unseeded = Sequence("u", [1], SamplingParams())
    with pytest.raises(ValueError, match="sampling seed"):
        sampler(random_logits(1), [unseeded])


def test_an_unfiltered_row_draws_the_same_beside_a_top_p_row():
    """A defect of the first sampler: one top-k/top-p row sorted the whole batch's vocabulary, so a
    seeded request without them drew another token than alone."""
    plain = dict(temperature=0.9, seed=21)
    alone = sample_steps(Sampler(4), [make_seq("p", **plain)], lambda s: random_logits(1, s, scale=1.0), 10)[0]

    def pair_logits(step):
        return torch.cat([random_logits(1, step, scale=1.0), random_logits(1, 500 + step)])

    crowd = [make_seq("p", **plain), make_seq("f", top_p=0.9, seed=3)]
    assert sample_steps(Sampler(4), crowd, pair_logits, 10)[0] == alone


@pytest.mark.parametrize("top_k", [1, 2])
def test_top_k_keeps_the_tokens_tied_with_the_kth(top_k):
    """A defect: top-k kept exactly k tokens in token-id order, so of two tokens with the same logit (common
    for bf16 logits) the lower id kept its probability and the other got none. vLLM and transformers keep
    every token as likely as the k-th; tied tokens are drawn equally often."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 40] = 2.0
    logits[0, [9, 30]] = 2.0 if top_k == 1 else 1.0               # ties with the k-th most likely
    kept = [40, 9, 30]
    seqs = [make_seq(str(i), seed=i, top_k=top_k) for i in range(512)]
    tokens = Sampler(512)(logits.expand(512, VOCAB).contiguous(), seqs).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    assert set(tokens) == set(kept)
    probs = torch.softmax(logits[0, kept], -1)
    assert (counts[kept] / 512 - probs).abs().max() < 0.07


def test_the_draw_resolves_tokens_far_below_2_to_the_minus_26():
    """A defect: the draw used a 26-bit random number, so the inverse CDF stepped by 2^-26 of the mass and
    a token below 2^-26 was drawn with probability 0 or 2^-26 (on a 152k vocabulary ~3e-4 of the mass moved
    per token), not with its probability quantized to 2^-36 as documented. The pick is the inverse CDF of
    the quantized weights at u = random_bits(seed, step) / 2^52, exactly: checked here on the seeds whose u
    falls among 2^15 tokens of probability ~2^-30 each (16 of them per 2^-26 step)."""
    vocab = 2**15
    logits = torch.full((1, vocab), -30 * math.log(2))
    logits[0, -1] = 0.0
    weights = (torch.softmax(logits[0], -1) * 2.0**36).long().tolist()
    total, cdf = sum(weights), list(itertools.accumulate(weights))
    tiny_mass = cdf[-2] / total                                    # ~3e-5
    seeds = list(range(2**18))
    bits = random_bits_batch(seeds, [0] * len(seeds))
    assert max(bits) < 2**52 and max(bits) >= 2**51
    chosen = [s for s, b in zip(seeds, bits, strict=True) if b / 2**52 < tiny_mass][:8]
    assert len(chosen) >= 4
    expected = [bisect.bisect_right(cdf, total * random_bits(s, 0) >> 52) for s in chosen]
    assert max(expected) < vocab - 1                               # all among the tiny tokens
    seqs = [make_seq(str(s), seed=s) for s in chosen]
    assert Sampler(8)(logits.expand(len(seqs), vocab).contiguous(), seqs).token_ids == expected
