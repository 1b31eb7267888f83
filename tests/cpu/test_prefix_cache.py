"""n samples per request and automatic prefix caching: the block manager, the scheduler, and `LLM` end to end
on CPU (fp32 tiny model)."""

import random

import pytest

from torpor.engine import LLM, SamplingParams
from torpor.engine.block_manager import BlockManager
from torpor.engine.config import EngineConfig
from torpor.engine.scheduler import Scheduler
from torpor.engine.sequence import Sequence, sample_seed
from torpor.engine.weights.loader import iter_checkpoint

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=16, block_size=8)


def seq_of(tokens, request_id="r", **params) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(**params))


# ---- block manager -----------------------------------------------------------------------------
def test_full_blocks_are_shared_and_freed_with_their_last_holder():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = seq_of(range(10), "a"), seq_of([*range(8), 50, 51, 52], "b")
    bm.allocate(a)
    assert a.num_cached_tokens == 0 and a.block_table == [0, 1, 2] and bm.num_cached_blocks == 2
    bm.allocate(b)  # the first 8 tokens (2 full blocks) are a's
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8 and b.num_prefix_cached_tokens == 8
    assert [bm.ref_count(i) for i in a.block_table] == [2, 2, 1] and bm.num_used_blocks == 4
    bm.deallocate(a)
    assert [bm.ref_count(i) for i in b.block_table] == [1, 1, 1] and bm.num_used_blocks == 3
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # free, still findable
    c = seq_of([*range(8), 9], "c")
    bm.allocate(c)
    assert c.block_table[:2] == [0, 1] and c.num_cached_tokens == 8
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (10 + 11 + 9, 16)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(range(8), "a")
    bm.allocate(a)
    bm.deallocate(a)
    b = seq_of(range(8), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.num_new_tokens == 4  # block 2 holds the last token: recomputed


def test_least_recently_freed_blocks_are_evicted_first_tail_before_head():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = seq_of(range(5), "a")  # blocks 0, 1 full and cached, block 2 partial
    bm.allocate(a)
    bm.deallocate(a)  # freed tail first: 2, 1, 0 after the never-used block 3
    big = seq_of(range(100, 105), "big")  # needs 3 blocks: 3, 2, 1 are taken, 1 evicted
    bm.allocate(big)
    assert sorted(big.block_table) == [1, 2, 3] and bm.num_cached_blocks == 3  # block 0 + big's two
    again = seq_of(range(5), "again")
    assert bm.num_hit_tokens_for(again) == 2  # the head of a's prefix survived, its tail did not


def test_reset_prefix_cache_forgets_keys_and_stops_older_sequences_registering():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = seq_of(range(3), "a")
    bm.allocate(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_hit_tokens_for(seq_of(range(3), "b")) == 0
    a.append_token(7)
    bm.may_append(a)  # a's second block is full now, but it was computed before the reset
    assert bm.num_cached_blocks == 0


def test_hash_collisions_are_misses_not_wrong_hits(monkeypatch):
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = seq_of([1, 2, 3], "a")
    bm.allocate(a)
    b = seq_of([4, 5, 6], "b")
    b.block_keys = list(a.block_keys)  # pretend b's first block hashes like a's
    assert bm.num_hit_tokens_for(b) == 0


def test_a_crafted_collision_of_pythons_hash_serves_no_other_prefix():
    # hash((0, (9, 180455074271894158))) == 0, the parent key of a first block (CPython's tuple hash can be
    # inverted): with Python's hash as the key, b's second block would look like a's first block (same
    # tokens, same parent key) and b would read a's K/V, computed at positions 0-1 after no prefix.
    crafted = [9, 180455074271894158]
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm.allocate(seq_of([*crafted, 5], "c"))  # the crafted block is cached
    bm.allocate(seq_of([7, 9, 11], "a"))     # so is the block (7, 9) at the head of a prompt
    assert bm.num_hit_tokens_for(seq_of([*crafted, 7, 9, 11], "b")) == 2  # the crafted block only


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = seq_of(range(5), "a"), seq_of(range(5), "b")
    bm.allocate(a)
    bm.allocate(b)
    assert not set(a.block_table) & set(b.block_table) and b.num_cached_tokens == 0


# ---- scheduler: n samples ------------------------------------------------------------------------
def make_scheduler(enable_prefix_caching=True, num_kv_blocks=32, max_num_seqs=8, max_n=8) -> Scheduler:
    config = EngineConfig(model="unused", max_model_len=32, max_num_seqs=max_num_seqs, block_size=4,
                          num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching, max_n=max_n)
    return Scheduler(config, eos_token_ids=[1])


def test_n_samples_prefill_the_prompt_once_and_copy_the_partial_block():
    sched = make_scheduler()
    samples = sched.add(seq_of(range(100, 110), "a", n=3, seed=7, max_tokens=2))
    assert [s.index for s in samples] == [0, 1, 2] and list(sched.waiting) == samples[:1]
    assert [s.sampling_seed for s in samples] == [sample_seed(7, i) for i in range(3)]
    assert len({s.sampling_seed for s in samples}) == 3
    seqs, is_prefill = sched.schedule()
    assert is_prefill and seqs == samples
    assert [s.shares_prefill for s in seqs] == [False, True, True]
    first = samples[0]
    for child in samples[1:]:
        assert child.block_table[:2] == first.block_table[:2]  # 8 prompt tokens in 2 shared full blocks
        assert child.block_table[2] != first.block_table[2]    # the partial block is its own...
        assert child.fork_copy == (first.block_table[2], child.block_table[2])  # ...copied from sample 0's
    assert sched.block_manager.num_used_blocks == 3 + 2
    sched.postprocess(seqs, [20, 21, 22])
    assert all(s.num_cached_tokens == 10 and not s.shares_prefill and s.fork_copy is None for s in samples)
    seqs, is_prefill = sched.schedule()
    assert not is_prefill and seqs == samples
    sched.postprocess(seqs, [30, 31, 32])
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 32


def test_n_samples_without_prefix_caching_are_independent_sequences():
    sched = make_scheduler(enable_prefix_caching=False)
    samples = sched.add(seq_of(range(100, 110), "a", n=3, max_tokens=1))
    seqs, _ = sched.schedule()
    assert seqs == samples and not any(s.shares_prefill for s in seqs)
    assert len({b for s in seqs for b in s.block_table}) == 9


def test_n_samples_are_admitted_together_or_not_at_all():
    sched = make_scheduler(max_num_seqs=4)
    sched.add(seq_of(range(100, 104), "a", max_tokens=4))
    sched.add(seq_of(range(200, 204), "b", n=4, max_tokens=4))
    seqs, _ = sched.schedule()
    assert [s.request_id for s in seqs] == ["a"]  # 1 + 4 > max_num_seqs: b waits whole
    assert sched.abort("b").request_id == "b" and [s.request_id for s in sched.running] == ["a"]
    assert not sched.waiting


def test_bad_n_is_refused_naming_it():
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be an int"):
        SamplingParams(n=2.0)
    sched = make_scheduler(max_n=4)
    with pytest.raises(ValueError, match="n must be <= 4"):
        sched.add(seq_of(range(4), "a", n=5))
    with pytest.raises(ValueError, match="max_n"):
        EngineConfig(model="m", max_n=0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model="m", enable_prefix_caching=1)
    assert sched.is_finished()


# ---- LLM end to end ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cached(tiny_model_path):
    return LLM(tiny_model_path, **ENGINE)


@pytest.fixture(scope="module")
def uncached(tiny_model_path):
    return LLM(tiny_model_path, enable_prefix_caching=False, **ENGINE)


def shared_prefix_requests(seed=0):
    rng = random.Random(seed)
    head = [rng.randrange(1000) for _ in range(27)]
    prompts = [head + [rng.randrange(1000) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    prompts += [[rng.randrange(1000) for _ in range(rng.randint(3, 40))] for _ in range(2)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=None if i % 2 == 0 else 100 + i,
                             max_tokens=10, logprobs=2, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def completions(outputs):
    return [[(c.index, c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def logprobs_of(outputs):
    """Every output token's top logprobs, as plain (token id, logprob) pairs."""
    return [[[sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs] for c in o.outputs]
            for o in outputs]


def test_cached_answers_equal_uncached_answers(cached, uncached):
    prompts, params = shared_prefix_requests()
    cached.reset_prefix_cache()
    want = uncached.generate(prompts, params)
    cold = cached.generate(prompts, params)      # hits within the batch (the shared head)
    warm = cached.generate(prompts, params)      # hits from the first round
    assert [o.num_cached_tokens for o in want] == [0] * len(prompts)
    assert sum(o.num_cached_tokens for o in cold) >= 4 * 24 and all(o.num_cached_tokens for o in warm)
    assert completions(cold) == completions(want) and completions(warm) == completions(want)
    assert logprobs_of(cold) == logprobs_of(want) and logprobs_of(warm) == logprobs_of(want)  # bit-identical


def test_a_prefix_cached_by_a_shorter_prefill_gives_the_bits_of_a_whole_prefill(cached, uncached):
    # The cached block's K/V (layers > 0) come from a 9-token prefill; the uncached prompt's from a longer one:
    # attention must not depend on how many keys follow a query's own.
    rng = random.Random(3)
    head = [rng.randrange(1000) for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=2)
    for length in range(9, 40, 3):
        prompt = head + [rng.randrange(1000) for _ in range(length - 8)]
        cached.reset_prefix_cache()
        cached.generate([[*head, 7]], SamplingParams(max_tokens=1))
        got, want = cached.generate([prompt], params)[0], uncached.generate([prompt], params)[0]
        assert got.num_cached_tokens == 8
        assert logprobs_of([got]) == logprobs_of([want]), length


def test_prefill_attention_rows_depend_on_neither_query_nor_key_count():
    import torch

    from torpor.engine.attention.torch_backend import causal_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(300, heads, 32, generator=gen) for heads in (4, 2, 2))
    rng = random.Random(0)
    for _ in range(40):
        length = rng.randint(1, 200)
        first, other = rng.randrange(length), rng.randrange(length)  # two cached-prefix lengths
        longer = rng.randint(length, 300)                              # and a longer prompt with this head
        a = causal_attention(q[first:length], k[:length], v[:length], first, 0.1)
        b = causal_attention(q[other:longer], k[:longer], v[:longer], other, 0.1)
        start = max(first, other)
        assert torch.equal(a[start - first :], b[start - other : length - other]), (length, first, other, longer)


def test_prompt_logprobs_requests_compute_their_whole_prompt(cached, uncached):
    prompts, _ = shared_prefix_requests(seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3, logprobs=1)
    cached.generate(prompts, SamplingParams(max_tokens=1))  # every prompt's blocks are cached now
    got, want = cached.generate(prompts, params), uncached.generate(prompts, params)
    assert [o.num_cached_tokens for o in got] == [0] * len(prompts)
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in want]
    assert completions(got) == completions(want)


def test_reset_prefix_cache_and_new_weights_empty_the_cache(cached, tiny_model_path):
    prompt = list(range(300, 340))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    cached.generate([prompt], params)
    assert cached.generate([prompt], params)[0].num_cached_tokens == 32
    assert cached.reset_prefix_cache() is True
    assert cached.generate([prompt], params)[0].num_cached_tokens == 0
    before = cached.generate([prompt], params)[0]
    assert before.num_cached_tokens == 32
    cached.update_weights(iter_checkpoint(tiny_model_path))  # a trainer's push: stale K/V must go
    assert cached.generate([prompt], params)[0].num_cached_tokens == 0
    cached.generate([prompt], params)
    cached.reload_weights()
    assert cached.generate([prompt], params)[0].num_cached_tokens == 0


def test_n_samples_end_to_end(cached, uncached):
    prompt = list(range(500, 537))  # 37 tokens: 4 full blocks + a partial one, forked per sample
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=1, n=4)
    out = cached.generate([prompt], seeded)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # the samples really differ
    again = cached.generate([prompt], seeded)[0]
    assert completions([again]) == completions([out])          # reproducible per (seed, index)
    independent = uncached.generate([prompt], seeded)[0]      # without caching: 4 full prefills
    assert completions([independent]) == completions([out])
    assert logprobs_of([independent]) == logprobs_of([out])  # bit-identical
    one = cached.generate([prompt], SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True))[0]
    assert one.outputs[0].token_ids == out.outputs[0].token_ids  # sample 0 is the n=1 request
    greedy = cached.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, n=3, logprobs=2))[0]
    assert all(c.token_ids == greedy.outputs[0].token_ids and c.logprobs == greedy.outputs[0].logprobs
               for c in greedy.outputs)


def test_n_samples_with_stops_prompt_logprobs_and_aborts(cached):
    prompt = list(range(600, 613))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=3, prompt_logprobs=1, stop_token_ids=[5])
    out = cached.generate([prompt], params)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    engine = cached.engine
    engine.add_request(prompt, SamplingParams(temperature=1.0, n=3, max_tokens=50, ignore_eos=True), "x")
    engine.step()
    aborted = engine.abort_request("x")
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3 and engine.is_finished()
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_n_over_the_engine_maximum_queues_nothing(cached):
    with pytest.raises(ValueError, match="n must be <= 16"):
        cached.generate(["a", "b"], [SamplingParams(), SamplingParams(n=17)])
    assert cached.engine.is_finished()


def test_preempted_samples_recompute_and_finish(tiny_model_path):
    llm = LLM(tiny_model_path, **{**ENGINE, "num_kv_blocks": 16})  # 128 tokens of KV for 4 x 60
    prompt = list(range(700, 720))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, n=4)
    out = llm.generate([prompt], params)[0]
    ref = LLM(tiny_model_path, **ENGINE).generate([prompt], params)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_bench_generate_runs_on_cpu(tiny_model_path, tmp_path, capsys):
    from torpor.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", "generate", "--model", tiny_model_path, "--device", "cpu", "--num-prompts", "3",
                 "--prompt-len", "20", "--n", "3", "--output-len", "4", "--max-num-seqs", "16", "--hf-prompts", "1",
                 "--hf-batch-size", "1", "--profile", "2", "--json", str(out)]) == 0
    import json

    printed = capsys.readouterr().out
    assert "CPU smoke run: no goal" in printed and "goal >=" not in printed  # the goals are GPU figures
    result = json.loads(out.read_text())
    assert result["cached"]["output_tokens"] == result["uncached"]["output_tokens"] == 3 * 3 * 4
    assert result["transformers"]["output_tokens"] == 3 * 4 and result["caching_speedup"] > 0
    top = result["cached"]["profile_top"]  # where the time goes: the top operators (kernels on a GPU)
    assert len(top) == 20 and top[0]["s"] > 0
    steps = result["cached"]["decode_steps"]  # wall time per decode step; the device's needs CUDA
    assert steps["steps"] == 3 and steps["wall_s"] > 0 and steps["device_s"] is None
    assert "output tokens/s" in printed and "prefix caching on against off" in printed


# ---- randomized stress: the real engine, a small KV cache, mixed requests and aborts ----------------------
def random_requests(rng, count, max_model_len, vocab):
    """Prompts sharing a few heads (some ending on a block boundary), n samples, greedy and seeded, logprobs
    and prompt logprobs; each with the number of steps to wait before it is added."""
    heads = [[rng.randrange(vocab) for _ in range(rng.choice([4, 8, 13, 24]))] for _ in range(3)]
    requests = []
    for _ in range(count):
        length = rng.choice([8, 16, rng.randint(1, max_model_len - 2)])
        prompt = (rng.choice(heads) + [rng.randrange(vocab) for _ in range(length)])[:length]
        greedy = rng.random() < 0.4
        params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=None if greedy else rng.randrange(1000),
                                max_tokens=rng.randint(1, min(12, max_model_len - length)),
                                ignore_eos=rng.random() < 0.7, logprobs=rng.choice([None, 0, 2]),
                                prompt_logprobs=2 if rng.random() < 0.15 else None, n=rng.choice([1, 1, 2, 3]))
        requests.append((rng.randint(0, 2), prompt, params))
    return requests


def check_blocks(scheduler):
    """Every block is held exactly by the running sequences whose tables name it; free blocks by none."""
    bm = scheduler.block_manager
    holders = [set() for _ in range(bm.num_blocks)]
    for seq in scheduler.running:
        for block_id in seq.block_table:
            holders[block_id].add(seq.seq_id)
    assert all(not seq.block_table for seq in scheduler.waiting)
    assert [len(h) for h in holders] == [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert bm.num_free_blocks == sum(1 for h in holders if not h)


def run_requests(llm, requests, abort_rng=None):
    """Add the requests over the steps, abort some at random; check the blocks after every step. Returns the
    finished outputs by request id and the aborted ids."""
    engine, pending, outputs, aborted = llm.engine, list(enumerate(requests)), {}, set()
    wait = pending[0][1][0] if pending else 0
    while pending or not engine.is_finished():
        while pending and wait <= 0:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, request_id=str(i))
            wait = pending[0][1][0] if pending else 0
        wait -= 1
        if abort_rng is not None and abort_rng.random() < 0.08 and engine._requests:
            request_id = abort_rng.choice(sorted(engine._requests))
            outputs[request_id] = engine.abort_request(request_id)
            aborted.add(request_id)
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        check_blocks(engine.scheduler)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    return outputs, aborted


def answers(output):
    """An engine output's samples: tokens, text, finish reason and logprobs ({id: float}), and its prompt logprobs."""
    return completions([output]), [c.logprobs for c in output.outputs], output.prompt_logprobs


@pytest.mark.parametrize("seed", range(3))
def test_random_requests_with_aborts_and_preemption_leak_no_block(tiny_model_path, seed):
    options = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8, block_size=4)
    small = LLM(tiny_model_path, num_kv_blocks=20, **options)  # 80 tokens of KV: eviction and preemption
    requests = random_requests(random.Random(seed), 30, 64, small.engine.vocab_size)
    outputs, aborted = run_requests(small, requests, random.Random(seed))
    assert aborted and len(outputs) == len(requests)
    assert all(c.finish_reason == "abort" for r in aborted for c in outputs[r].outputs)


@pytest.mark.parametrize("seed", range(3))
def test_random_requests_are_bit_identical_with_and_without_caching(tiny_model_path, seed):
    # Enough KV and sequence slots that both engines run the same batches (the decode batches decide bits).
    options = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=64, block_size=4,
                   num_kv_blocks=400)
    on, off = LLM(tiny_model_path, **options), LLM(tiny_model_path, enable_prefix_caching=False, **options)
    requests = random_requests(random.Random(seed), 30, 64, on.engine.vocab_size)
    got, _ = run_requests(on, requests)
    want, _ = run_requests(off, requests)
    assert sum(o.num_cached_tokens for o in got.values()) > 0
    assert {r: answers(o) for r, o in got.items()} == {r: answers(o) for r, o in want.items()}
