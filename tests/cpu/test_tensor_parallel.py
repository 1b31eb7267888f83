"""Tensor parallelism over two CPU processes (gloo): outputs equal one process, the bit-exact sleep/wake
harness at TP=2, a sleep failing on one rank rolled back everywhere, a killed worker reported, weights
streamed through the process group, every rank's memory reported, the collective teardown, workers
that ignore Ctrl-C and exit with rank 0, clear errors for a failed start-up and for missing devices.

Logprobs are compared with TP=1 within LOGPROB_TOLERANCE: the row-parallel layers sum partial products
in another order than one GEMM does, so results differ in the last bits (fp32). Within TP=2, every
sleep/wake round must equal TP=2's own first round exactly."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from torpor.engine import LLM, SamplingParams
from torpor.engine.config import EngineConfig
from torpor.engine.executor import RankError, WorkerDiedError
from torpor.engine.executor.multiproc import check_devices
from torpor.engine.weights.loader import iter_checkpoint
from torpor.memory import HostMemoryError
from torpor.testing.harness import differences, fixed_requests, run_harness, run_round

LOGPROB_TOLERANCE = 1e-4  # fp32, 2 layers, 2 ranks: observed differences are ~1e-6
OPTIONS = dict(device="cpu", max_num_seqs=16, max_model_len=128)


def _greedy_requests(vocab_size: int) -> list:
    requests = fixed_requests(8, vocab_size, seed=1, max_prompt=40, max_tokens=10)
    return [(p, SamplingParams(temperature=0.0, max_tokens=sp.max_tokens, logprobs=2, prompt_logprobs=2,
                               ignore_eos=True)) for p, sp in requests]


def _close_all(outputs_a, outputs_b) -> None:
    for a, b in zip(outputs_a, outputs_b, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert lp_a.keys() == lp_b.keys()
            assert all(abs(lp_a[t].logprob - lp_b[t].logprob) < LOGPROB_TOLERANCE for t in lp_a)


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_path):
    """TP=1 outputs, made before any tensor-parallel engine exists (one process group per process)."""
    llm = LLM(tiny_model_path, enable_sleep_mode=False, **OPTIONS)
    requests = _greedy_requests(llm.engine.vocab_size)
    return requests, run_round(llm, requests)


@pytest.fixture(scope="class")
def tp_llm(tiny_model_path, greedy_reference):
    """Closed when TestTwoRanks ends: the other tests build their own engines (one group per process)."""
    llm = LLM(tiny_model_path, tensor_parallel_size=2, **OPTIONS)
    yield llm
    llm.close()


class TestTwoRanks:

    def test_kv_cache_is_sharded_by_kv_heads(self, tp_llm):
        assert tp_llm.engine.executor.driver.runner.kv_cache.shape[-2] == 1  # tiny: 2 kv heads over 2 ranks

    def test_greedy_outputs_equal_one_rank(self, tp_llm, greedy_reference):
        requests, reference = greedy_reference
        _close_all(reference, run_round(tp_llm, requests))

    def test_a_one_rank_engine_beside_it_answers_too(self, tp_llm, tiny_model_path, greedy_reference):
        requests, reference = greedy_reference  # each engine has its own process group: no shared collectives
        one = LLM(tiny_model_path, enable_sleep_mode=False, **OPTIONS)
        _close_all(reference, run_round(one, requests))
        _close_all(reference, run_round(tp_llm, requests))
        one.close()

    def test_every_rank_reports_its_memory(self, tp_llm):
        usage = tp_llm.memory_usage()
        ranks = usage["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert ranks[0]["pid"] == os.getpid() and ranks[1]["pid"] == tp_llm.engine.executor.processes[0].pid
        assert [r["device"] for r in ranks] == ["cpu", "cpu"]
        for r in ranks:
            assert r["device_used_bytes"] > 0 and r["cuda_graphs"] == 0
            assert r["tags"]["weights"]["allocated_bytes"] > 0  # each rank's own shard
        assert ranks[0]["tags"]["kv_cache"] == usage["tags"]["kv_cache"]

    def test_update_weights_streams_to_every_rank_and_survives_a_bad_name(self, tp_llm, greedy_reference):
        requests, reference = greedy_reference
        named = dict(iter_checkpoint(tp_llm.config.model))
        name = "model.layers.0.mlp.down_proj.weight"  # row-parallel: each rank keeps different columns
        assert tp_llm.update_weights([(name, torch.zeros_like(named[name]))]) == 1
        assert run_round(tp_llm, requests)[0].outputs[0].logprobs != reference[0].outputs[0].logprobs
        with pytest.raises(ValueError, match=r"unknown tensor 'model\.no_such\.weight'"):  # refused, nobody hangs
            tp_llm.update_weights([(name, named[name]), ("model.no_such.weight", named[name])])
        assert tp_llm.update_weights(named.items()) == len(named)
        _close_all(reference, run_round(tp_llm, requests))

    def test_workers_ignore_ctrl_c(self, tp_llm, greedy_reference):
        requests, reference = greedy_reference
        worker = tp_llm.engine.executor.processes[0]
        os.kill(worker.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches every process of its group
        time.sleep(0.2)
        assert worker.is_alive()
        _close_all(reference, run_round(tp_llm, requests))

    def test_bit_exact_after_every_kind_of_wake(self, tp_llm):
        requests = fixed_requests(12, tp_llm.engine.vocab_size, max_prompt=32, max_tokens=8)
        results = run_harness(tp_llm, requests, log=lambda line: None)
        assert len(results) == 6
        assert [s.name for s in results if s.mismatches] == []


def test_indivisible_heads_are_rejected_before_starting(tiny_model_path):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible"):
        LLM(tiny_model_path, tensor_parallel_size=3, **OPTIONS)


def test_sleep_failing_on_one_rank_leaves_every_rank_awake(tiny_model_path):
    # Rank 1 may hold only 4 KiB of host copies: offloading its weights fails there, for real.
    llm = LLM(tiny_model_path, tensor_parallel_size=2, worker_memory_options={1: {"max_host_bytes": 4096}},
              **OPTIONS)
    try:
        requests = fixed_requests(6, llm.engine.vocab_size, max_prompt=24, max_tokens=6)
        before = run_round(llm, requests)
        for level in (1, 2):  # level 2 discards the weights: the roll-back reloads them
            with pytest.raises(RankError, match="rank 1: HostMemoryError") as error:
                llm.sleep(level)
            assert error.value.rank == 1 and isinstance(error.value.cause, HostMemoryError)
            assert not llm.is_sleeping() and not llm.memory.is_sleeping()
            assert differences(before, run_round(llm, requests)) == []
    finally:
        llm.close()


def test_killed_worker_is_reported_not_a_hang(tiny_model_path):
    llm = LLM(tiny_model_path, tensor_parallel_size=2, tp_timeout_s=30.0, **OPTIONS)
    try:
        worker = llm.engine.executor.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+, exit code -9\)"):  # WorkerDiedError or not
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # serving: the watch thread found it
        with pytest.raises(WorkerDiedError, match="unusable"):
            llm.sleep(1)
        assert "exit code -9" in llm.engine.health()
        assert time.perf_counter() - start < 10
    finally:
        llm.close()
    assert not worker.is_alive()


def test_a_failed_step_leaves_the_engine_unusable_not_hung(tiny_model_path):
    from torpor.engine.sequence import Sequence

    llm = LLM(tiny_model_path, tensor_parallel_size=2, enable_sleep_mode=False, tp_timeout_s=60.0, **OPTIONS)
    try:
        worker = llm.engine.executor.processes[0]
        bad = Sequence("no-blocks", [1, 2, 3], SamplingParams())  # no KV blocks: the step fails on every rank
        start = time.perf_counter()
        with pytest.raises(IndexError):  # rank 0's own error
            llm.engine.executor.execute_model([bad], True)
        worker.join(timeout=10)
        assert worker.exitcode == 1  # the worker replied its error, then left: the ranks may be out of step
        with pytest.raises(RuntimeError, match="cannot serve any more: a step failed on rank 0: "):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        assert time.perf_counter() - start < 20
    finally:
        llm.close()


def test_close_stops_the_workers(tiny_model_path):
    llm = LLM(tiny_model_path, tensor_parallel_size=2, **OPTIONS)
    processes = llm.engine.executor.processes
    start = time.perf_counter()
    llm.close()  # every rank leaves together (a barrier first: NCCL's teardown is collective)
    assert time.perf_counter() - start < 5
    assert [p.exitcode for p in processes] == [0]  # not killed: the worker met rank 0 in the teardown
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="cannot serve any more: it was closed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_a_worker_failing_at_start_up_is_reported_with_its_error(tiny_model_path):
    with pytest.raises(RankError, match="rank 1: TypeError") as error:
        LLM(tiny_model_path, tensor_parallel_size=2, worker_memory_options={1: {"no_such_option": 1}}, **OPTIONS)
    assert isinstance(error.value.cause, TypeError)
    assert not torch.distributed.is_initialized()  # the next engine can start
    llm = LLM(tiny_model_path, tensor_parallel_size=2, enable_sleep_mode=False, **OPTIONS)
    llm.close()


@pytest.mark.slow  # a subprocess
def test_workers_exit_when_rank_0_dies(tiny_model_path):
    script = ("import sys, time; from torpor.engine import LLM; "
              f"llm = LLM({tiny_model_path!r}, tensor_parallel_size=2, device='cpu', max_model_len=64, "
              "enable_sleep_mode=False); "
              "print(llm.engine.executor.processes[0].pid, flush=True); time.sleep(60)")
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(rank0.stdout.readline())
        rank0.kill()  # no clean-up runs in rank 0
        rank0.wait()
        deadline = time.monotonic() + 10
        while _alive(worker_pid):
            assert time.monotonic() < deadline, "the worker outlived rank 0"
            time.sleep(0.1)
    finally:
        if rank0.poll() is None:
            rank0.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited (init reaps it later)
    except FileNotFoundError:
        return False


def test_devices_of_every_rank_must_be_visible(monkeypatch, tiny_model_path):
    config = EngineConfig(model=tiny_model_path, device="cuda:1", tensor_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"needs devices cuda:1\.\.cuda:2 \(one per rank\), but 2 CUDA"):
        check_devices(config)
    check_devices(dataclasses.replace(config, device="cuda:0"))
    check_devices(dataclasses.replace(config, device="cpu", tensor_parallel_size=8))


def test_a_script_without_a_main_guard_fails_fast_and_says_why(tiny_model_path, tmp_path):
    """The spawn start method re-imports the main module in every worker: a script that builds the LLM at
    its top level makes each worker build one too and die. Start-up must fail within seconds, naming
    the cause (before: a 10-minute wait in the rendezvous, then a DistStoreError)."""
    script = tmp_path / "no_guard.py"
    script.write_text(f"from torpor.engine import LLM\nLLM({tiny_model_path!r}, tensor_parallel_size=2, "
                      "device='cpu', max_model_len=64, enable_sleep_mode=False)\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.getcwd()}, cwd=tmp_path)
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    assert "WorkerDiedError" in result.stderr and 'if __name__ == "__main__":' in result.stderr


def test_step_message_to_workers_carries_only_what_they_need():
    """A decode step of 256 sequences x 2k tokens with logprobs: the workers get the new tokens, lengths and
    block tables, not every token and logprob (measured before: 2.1 MiB per step, 7.4 MiB with logprobs)."""
    import pickle
    import random

    from torpor.engine.sequence import Sequence
    from torpor.engine.step_batch import StepBatch

    rng = random.Random(0)
    seqs = []
    for i in range(256):
        seq = Sequence(str(i), [rng.randrange(150_000) for _ in range(1024)], SamplingParams(logprobs=5))
        for _ in range(1024):
            token = rng.randrange(150_000)  # the sampled token is among its logprobs, as the sampler gives them
            seq.append_token(token, {token: -rng.random(), **{rng.randrange(150_000): -rng.random() for _ in range(5)}})
        seq.block_table = list(range(i * 128, (i + 1) * 128))  # 2048 tokens / 16 per block
        seqs.append(seq)
    whole, lean = len(pickle.dumps((seqs, False))), len(pickle.dumps((StepBatch.pack(seqs, False),)))
    print(f"decode step message: {whole / 2**20:.2f} MiB as Sequences, {lean / 2**10:.1f} KiB as a StepBatch")
    assert lean * 20 < whole and lean < 160 * 2**10
    views = pickle.loads(pickle.dumps(StepBatch.pack(seqs, False))).sequences()
    assert [(len(v), v.last_token_id, v.block_table) for v in views] == \
        [(len(s), s.last_token_id, s.block_table) for s in seqs]


def test_prefill_views_match_the_sequences():
    from torpor.engine.sequence import Sequence
    from torpor.engine.step_batch import StepBatch

    a = Sequence("a", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=2))
    b = Sequence("b", [1, 2, 3], SamplingParams())
    b.num_cached_tokens = 2  # its first two tokens are cached (a prefix-cache hit, or a chunk)
    a.block_table, b.block_table = [3], [4, 7]
    views = StepBatch.pack([a, b], True).sequences()
    assert views[0].token_ids == a.token_ids and views[0].prompt_token_ids == a.prompt_token_ids
    assert views[0].sampling_params.prompt_logprobs == 2 and views[1].sampling_params.prompt_logprobs is None
    assert views[1].token_ids[2:] == b.token_ids[2:] and len(views[1]) == 3 and views[1].request_id == "b"
