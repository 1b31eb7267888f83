"""Prefix caching and n samples on CUDA, with CUDA graphs and the Triton decode kernel, on the qwen3-0.6b
preset (bf16): caching on against caching off, greedy n, the bit-exact sleep/wake harness with caching on.

Prints what it measured (requests bit-identical with caching on vs off, the largest logprob difference)
so the GPU log shows how close the two paths are, beside the asserts."""

import gc
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.synthetic import cached_model_path  # noqa: E402
from torpor.testing.harness import fixed_requests, run_harness  # noqa: E402

ENGINE = dict(device="cuda", max_model_len=512, max_num_seqs=64, block_size=16, gpu_memory_utilization=0.4)


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(cached_model_path("qwen3-0.6b"))


@pytest.fixture(autouse=True)
def release_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def shared_prefix_workload(vocab_size: int, seed: int = 0):
    """Prompts that share heads of 64 and 200 tokens (whole blocks and a partial one), greedy and seeded."""
    rng = random.Random(seed)
    heads = [[rng.randrange(vocab_size) for _ in range(length)] for length in (64, 200)]
    prompts = [heads[i % 2] + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))] for i in range(16)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, seed=None if i % 2 == 0 else 77 + i,
                             max_tokens=32, logprobs=2, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def compare(got, want) -> tuple[int, int, float]:
    """(requests with equal tokens, requests bit-identical, largest logprob difference before any divergence)."""
    same_tokens = bit_identical = 0
    diff = 0.0
    for g, w in zip(got, want, strict=True):
        a, b = g.outputs[0], w.outputs[0]
        same_tokens += a.token_ids == b.token_ids
        bit_identical += a.token_ids == b.token_ids and a.logprobs == b.logprobs
        for x, y, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids, strict=True):
            diff = max([diff] + [abs(x[t].logprob - y[t].logprob) for t in x.keys() & y.keys()])
            if ta != tb:
                break
    return same_tokens, bit_identical, diff


def greedy_divergences(got, want, params) -> list[tuple[int, int, float]]:
    """(request, token, the uncached top-2 gap there) where a greedy request's tokens first differ."""
    found = []
    for i, (g, w, p) in enumerate(zip(got, want, params, strict=True)):
        a, b = g.outputs[0], w.outputs[0]
        if not p.is_greedy or a.token_ids == b.token_ids:
            continue
        j = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y)
        top = sorted((e.logprob for e in b.logprobs[j].values()), reverse=True)
        found.append((i, j, top[0] - top[1]))
    return found


def test_caching_on_equals_caching_off_with_cuda_graphs(model_path):
    off = LLM(model_path, enable_prefix_caching=False, **ENGINE)
    prompts, params = shared_prefix_workload(off.engine.vocab_size)
    want = off.generate(prompts, params)
    off.close()
    del off
    gc.collect()
    torch.cuda.empty_cache()
    on = LLM(model_path, **ENGINE)
    assert on.engine.executor.driver.runner.graphs is not None  # CUDA graphs on
    cold = on.generate(prompts, params)  # hits within the batch
    warm = on.generate(prompts, params)  # hits from the first round: whole heads cached
    assert all(o.num_cached_tokens >= 64 for o in warm)
    for name, got in (("cold", cold), ("warm", warm)):
        same, exact, diff = compare(got, want)
        divergences = greedy_divergences(got, want, params)
        print(f"\ncaching on ({name} cache) vs off: {same}/{len(prompts)} same tokens, {exact}/{len(prompts)} "
              f"bit-identical, largest logprob difference before a divergence {diff:.3g}; greedy divergences "
              f"(request, token, top-2 gap): {divergences or 'none'}")
        # Row-invariant prefills (gemm.row_invariant, one attention kernel): a prompt gets the same bits whether
        # prefilled whole or after a cached prefix, so caching changes no token and no logprob.
        assert exact == len(prompts), f"{name}: {len(prompts) - exact} requests differ (largest difference {diff:.3g})"
    on.reset_prefix_cache()
    assert compare(on.generate(prompts, params), cold)[1] == len(prompts)  # the same (empty) cache: bit-exact
    on.close()


def test_n_samples_caching_on_equals_caching_off(model_path):
    # GRPO's shape, small: with caching on the 8 samples of a prompt share its blocks and the decode kernel reads
    # each prompt's prefix once per group; off, every sample holds its own copy and is computed alone
    rng = random.Random(3)
    results, prompts = [], None
    for caching in (False, True):
        llm = LLM(model_path, enable_prefix_caching=caching, **ENGINE)
        prompts = prompts or [[rng.randrange(llm.engine.vocab_size) for _ in range(n)] for n in (100, 150, 200, 64)]
        params = [SamplingParams(temperature=1.0, seed=11 + i, n=8, max_tokens=40, logprobs=1, ignore_eos=True)
                  for i in range(len(prompts))]
        results.append(llm.generate(prompts, params))
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    off, on = ([(c.token_ids, c.logprobs) for r in rs for c in r.outputs] for rs in results)
    print(f"\nn=8 samples of 4 prompts, caching on vs off: {sum(a == b for a, b in zip(on, off, strict=True))}/"
          f"{len(off)} samples bit-identical")
    assert on == off


def test_n_samples_share_the_prompt_and_greedy_n_agree(model_path):
    llm = LLM(model_path, **ENGINE)
    prompt = [(7 * i) % 1000 + 1 for i in range(333)]  # 20 full blocks + a partial one, copied per sample
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, n=8, max_tokens=48, logprobs=1))[0]
    assert len(greedy.outputs) == 8
    assert all(c.token_ids == greedy.outputs[0].token_ids and c.logprobs == greedy.outputs[0].logprobs
               for c in greedy.outputs)
    params = SamplingParams(temperature=1.0, seed=5, n=8, max_tokens=48, ignore_eos=True)
    llm.reset_prefix_cache()  # both runs from an empty cache: the same computation, bit for bit
    first = llm.generate([prompt], params)[0]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 8
    llm.reset_prefix_cache()
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    before = llm.engine.prefix_cache_stats()
    llm.generate([prompt], SamplingParams(temperature=1.0, seed=6, n=8, max_tokens=4, ignore_eos=True))
    after = llm.engine.prefix_cache_stats()
    print(f"\nn=8 of a 333-token prompt: {after['hits'] - before['hits']} of {after['queries'] - before['queries']} "
          "prompt tokens from the cache")
    llm.close()


def test_sleep_wake_harness_bit_exact_with_caching(model_path):
    llm = LLM(model_path, **ENGINE)
    requests = fixed_requests(32, llm.engine.vocab_size, max_prompt=64, max_tokens=16)
    results = run_harness(llm, requests)
    assert [s.name for s in results if s.mismatches] == []
    llm.close()
