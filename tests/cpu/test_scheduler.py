import pytest

from torpor.engine.config import EngineConfig
from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.scheduler import Scheduler
from torpor.engine.sequence import Sequence, SequenceStatus

EOS = 1


def make_scheduler(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8,
                   max_num_batched_tokens=None, seed=0, enable_prefix_caching=False, max_n=256) -> Scheduler:
    config = EngineConfig(model="unused", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                          seed=seed, num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
                          max_n=max_n)
    return Scheduler(config, eos_token_ids=[EOS])


def make_seq(request_id, prompt_len=4, **params) -> Sequence:
    return Sequence(request_id, [100 + i for i in range(prompt_len)], SamplingParams(**params))


def fake_next_token(seq: Sequence) -> int:
    """A 'model' whose next token depends on the whole history (never EOS)."""
    return (sum(seq.token_ids) * 31 + len(seq)) % 50 + 10


def step(sched: Scheduler):
    seqs, is_prefill = sched.schedule()
    cfg, bm = sched.config, sched.block_manager
    held = [b for s in sched.running for b in s.block_table]
    assert len(set(held)) == bm.num_used_blocks
    assert all(bm.ref_count(b) == held.count(b) for b in set(held))
    if not cfg.enable_prefix_caching:
        assert len(held) == len(set(held))
    assert len(sched.running) <= cfg.max_num_seqs
    for s in seqs:
        assert s.status is SequenceStatus.RUNNING
        assert len(s.block_table) * cfg.block_size >= len(s)
        if not cfg.enable_prefix_caching:
            assert s.num_new_tokens == (len(s) if is_prefill else 1)
        elif not is_prefill:
            assert s.num_new_tokens == 1
    if is_prefill:
        assert sum(s.num_new_tokens for s in seqs if not s.shares_prefill) <= cfg.max_num_batched_tokens
    finished = sched.postprocess(seqs, [fake_next_token(s) for s in seqs])
    return [s.request_id for s in seqs], is_prefill, finished


def run(sched: Scheduler, max_steps=1000):
    log = []
    for _ in range(max_steps):
        if sched.is_finished():
            return log
        log.append(step(sched)[:2])
    raise AssertionError("scheduler did not finish")


def test_continuous_batching_admits_as_others_finish():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(r, max_tokens=n) for r, n in zip("abcd", (2, 5, 3, 3), strict=True)]
    for s in seqs:
        sched.add(s)
    log = run(sched)
    assert log[0] == (["a", "b"], True)
    assert log[1] == (["a", "b"], False)      # a finishes here (2 tokens)
    assert log[2] == (["c"], True)            # c joins while b still runs
    assert log[3] == (["b", "c"], False)
    assert [s.num_output_tokens for s in seqs] == [2, 5, 3, 3]
    assert all(s.finish_reason == "length" for s in seqs)
    assert sched.block_manager.num_free_blocks == 64


def test_prefill_respects_token_budget():
    sched = make_scheduler(max_model_len=25, max_num_batched_tokens=25)
    for r in "abc":
        sched.add(make_seq(r, prompt_len=10, max_tokens=2))
    assert step(sched)[:2] == (["a", "b"], True)
    assert step(sched)[:2] == (["c"], True)
    assert step(sched)[:2] == (["a", "b", "c"], False)


def test_preemption_recomputes_and_finishes_correctly():
    def outputs(num_kv_blocks):
        sched = make_scheduler(num_kv_blocks=num_kv_blocks, max_model_len=24)
        seqs = [make_seq(r, prompt_len=4 + i, max_tokens=12) for i, r in enumerate("abc")]
        for s in seqs:
            sched.add(s)
        log = run(sched)
        prefills = [r for ids, is_prefill in log if is_prefill for r in ids]
        return [s.output_token_ids for s in seqs], prefills, sched

    expected, prefills, _ = outputs(num_kv_blocks=64)
    assert sorted(prefills) == ["a", "b", "c"]                # no preemption with room
    got, prefills, sched = outputs(num_kv_blocks=6)           # 24 tokens for 3 x 16+ tokens
    assert len(prefills) > 3                                  # someone was preempted and recomputed
    assert prefills.count("a") == 1                           # the oldest is never the victim
    assert got == expected
    assert sched.block_manager.num_free_blocks == 6


def test_preemption_victim_is_newest_and_goes_to_front():
    sched = make_scheduler(num_kv_blocks=4, block_size=2, max_model_len=8, max_num_batched_tokens=8)
    a, b, late = make_seq("a", 2, max_tokens=6), make_seq("b", 2, max_tokens=6), make_seq("late", 2)
    sched.add(a)
    sched.add(b)
    step(sched)                               # prefill a, b: 1 block each
    sched.add(late)
    assert step(sched)[:2] == (["late"], True)
    ids, is_prefill, _ = step(sched)          # a and b each need a 2nd block: only 1 is free
    assert (ids, is_prefill) == (["a", "b"], False)
    assert late.status is SequenceStatus.WAITING and late.block_table == []
    assert sched.waiting[0] is late


def test_stop_conditions():
    sched = make_scheduler(max_model_len=8)
    eos, ign, stop_id, long = (make_seq("eos", max_tokens=10), make_seq("ign", max_tokens=2, ignore_eos=True),
                               make_seq("stop", stop_token_ids=[42]), make_seq("long", prompt_len=6))
    for s in (eos, ign, stop_id, long):
        sched.add(s)
    seqs, _ = sched.schedule()
    finished = sched.postprocess(seqs, [EOS, EOS, 42, 7])
    assert finished == [eos, stop_id]
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert (stop_id.finish_reason, stop_id.stop_reason) == ("stop", 42)
    seqs, is_prefill = sched.schedule()
    assert seqs == [ign, long] and not is_prefill
    finished = sched.postprocess(seqs, [EOS, 7])
    assert finished == [ign, long]
    assert ign.output_token_ids == [EOS, EOS] and ign.finish_reason == "length"
    assert len(long) == 8 and long.finish_reason == "length"       # max_model_len reached
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 64


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a"), make_seq("b")
    sched.add(a)
    sched.add(b)
    sched.schedule()                          # a runs, b waits
    assert sched.abort("b") is b and b.finish_reason == "abort" and not sched.waiting
    assert sched.abort("a") is a and a.block_table == [] and not sched.running
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert sched.block_manager.num_free_blocks == 64 and sched.is_finished()
    assert sched.postprocess([a], [5]) == [] and a.num_output_tokens == 0   # token of an aborted step
    sched.add(make_seq("a"))                  # finished ids can be reused


def test_engine_finish_for_stop_strings():
    sched = make_scheduler()
    s = make_seq("a", stop=["END"])
    sched.add(s)
    seqs, _ = sched.schedule()
    sched.postprocess(seqs, [9])
    sched.finish(s, "stop", "END")
    assert (s.finish_reason, s.stop_reason, s.block_table) == ("stop", "END", [])
    assert sched.is_finished()


def test_add_rejects_bad_requests():
    sched = make_scheduler(max_model_len=16)
    sched.add(make_seq("a"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(make_seq("a"))
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Scheduler(EngineConfig(model="m"))


def test_the_lifecycle_pauses_it_and_reset_blocks_recomputes():
    sched = make_scheduler()
    lifecycle = sched.lifecycle
    a = make_seq("a", max_tokens=5)
    sched.add(a)
    step(sched)
    lifecycle.pause("all")
    sched.add(make_seq("b", max_tokens=3))    # requests still queue while paused
    assert sched.schedule() == ([], False) and not sched.has_runnable()
    lifecycle.resume()
    lifecycle.pause("new")                    # the running one goes on, the new one waits
    assert step(sched)[:2] == (["a"], False) and sched.has_runnable()
    lifecycle.resume()
    sched.reset_blocks()                      # KV cache discarded while asleep
    assert a.status is SequenceStatus.WAITING and a.num_cached_tokens == 0
    assert sched.block_manager.num_free_blocks == 64
    assert step(sched)[:2] == (["a", "b"], True)   # a recomputes prompt + its output so far
    run(sched)
    assert a.num_output_tokens == 5 and a.finish_reason == "length"


def test_unseeded_requests_get_reproducible_seeds():
    def seeds(config_seed):
        sched = make_scheduler(seed=config_seed)
        seqs = [make_seq("a"), make_seq("b", seed=7)]
        for s in seqs:
            sched.add(s)
        return [s.sampling_seed for s in seqs]
    assert seeds(0) == seeds(0) and seeds(0)[1] == 7
    assert seeds(0)[0] != seeds(1)[0]


def test_config_validation_and_derived_values():
    cfg = EngineConfig(model="m", max_num_seqs=40, max_model_len=100, block_size=16)
    assert cfg.max_num_batched_tokens == 16384 and cfg.max_num_blocks_per_seq == 7
    assert cfg.cuda_graph_batch_sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    assert EngineConfig(model="m", max_num_seqs=3).cuda_graph_batch_sizes == (1, 2, 3)
    assert EngineConfig(model="m", max_model_len=32768).max_num_batched_tokens == 32768
    assert [cfg.padded_batch_size(n) for n in (1, 3, 9, 33, 40)] == [1, 4, 16, 40, 40]
    with pytest.raises(ValueError, match="num_seqs"):
        cfg.padded_batch_size(41)
    assert cfg.with_num_kv_blocks(7).num_kv_blocks == 7
    with pytest.raises(ValueError, match="max_model_len"):
        cfg.with_num_kv_blocks(6)             # 96 tokens < max_model_len 100


@pytest.mark.parametrize("kwargs, field", [
    ({"model": ""}, "model"), ({"dtype": "fp8"}, "dtype"), ({"device": "gpu"}, "device"),
    ({"max_model_len": 0}, "max_model_len"), ({"max_num_seqs": -1}, "max_num_seqs"),
    ({"block_size": 12}, "block_size"), ({"block_size": 0}, "block_size"),
    ({"max_num_batched_tokens": 100}, "max_num_batched_tokens"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"), ({"seed": None}, "seed"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
])
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{"model": "m", **kwargs})


def test_request_output_snapshot():
    sched = make_scheduler()
    s = Sequence("a", [5, 6], SamplingParams(max_tokens=2, logprobs=1), prompt="hi")
    sched.add(s)
    for token in (7, 8):
        seqs, _ = sched.schedule()
        sched.postprocess(seqs, [token], [{token: -0.5}])
    out = RequestOutput.from_sequence(s, "text")
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == ("a", "hi", [5, 6], True)
    (completion,) = out.outputs
    assert completion.token_ids == [7, 8] and completion.text == "text"
    assert completion.logprobs == [{7: -0.5}, {8: -0.5}] and completion.finish_reason == "length"
