"""Tensor parallelism over two GPUs (the exchange buffer's collectives, CUDA graphs capturing them; NCCL's
by default, where only the asleep bound is looser: NCCL's communicator stays; TORPOR_TEST_TP_COMM=torpor runs the
file with `tp_comm="torpor"`, the exchange buffer).

1. The tiny default model first (fast): start-up, every rank on its own device, graph capture on
   both ranks, outputs against one GPU, a short bit-exact sleep/wake harness, a clean collective close.
2. The synthetic qwen3-8b checkpoint (generated into the cache when missing, ~16 GB), one TP=2 engine
   for the module: device memory per GPU awake / asleep / against a bare CUDA context, the bit-exact
   harness (64 requests, every scenario exact), then greedy outputs against TP=1 on the same prompts.

TP=2 against TP=1 (bf16): the row-parallel layers round each rank's partial product to bf16 and the all-reduce
adds them (one GEMM accumulates in fp32 and rounds once), so logprobs differ slightly and a greedy token
can flip where the top two candidates are nearly tied. On these random-weight models near ties are
common (bf16 logits of order one: exact ties happen), so equal tokens everywhere is not the criterion
(docs/tensor-parallel.md has the CPU measurement behind the numbers). The check (`compare_greedy`):
  - prompt logprobs (teacher-forced, every prompt position, independent of generated tokens): the
    actual next token's logprob within PROMPT_LOGPROB_TOL, and within PROMPT_LOGPROB_MEAN_TOL on average;
  - generated tokens equal up to the first difference, their logprobs within TOKEN_LOGPROB_TOL;
  - a first difference only where TP=1's top-2 logprob gap is below FLIP_GAP (a near tie);
  - at least MIN_EQUAL_FRACTION of the requests (GREEDY_TOKENS tokens each) entirely equal.
Within the TP=2 engine, every sleep/wake round must equal its first round bit for bit.

Processes and devices: the test process is rank 0 (its LLM lives here) on cuda:0; rank 1 is a spawned
worker on cuda:1. Memory per GPU is read by each rank itself (`memory_usage()["ranks"]`: cudaMemGetInfo
of its own device, device-wide), so the test process never makes a context on cuda:1; with nvidia-ml-py,
NVML's per-GPU figures and processes are printed too (a context on the wrong GPU would show there).
"Bare": a fresh process holding only a CUDA context, measured on GPU 1 before the 8B engine starts (the
two GPUs are the same model). Run this file alone (scripts/gpu-check tp) for clean figures: memory is
device-wide, anything else on the GPUs counts. Figures are printed (`-s` or `-rA`) and, when
TORPOR_GPU_RESULTS_DIR is set, written to tensor-parallel.json there.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.synthetic import default_model_path  # noqa: E402
from torpor.testing.harness import differences, fixed_requests, run_harness, run_round  # noqa: E402

MiB = 1 << 20
# bf16 TP=2 vs TP=1 (see the module docstring). Measured on CPU (qwen3-0.6b, gloo): |prompt logprob
# diff| max 0.076, mean 0.016; first differences at top-2 gaps <= 0.0625; 42% of 16-token requests equal
# (48 requests; ~5% of the tokens flip): 8-token requests keep most of them equal.
PROMPT_LOGPROB_TOL = 0.25
PROMPT_LOGPROB_MEAN_TOL = 0.05
TOKEN_LOGPROB_TOL = 0.25
FLIP_GAP = 0.25
MIN_EQUAL_FRACTION = 0.3
GREEDY_TOKENS = 8
# Per GPU, at levels 1 and 2 (TP=1 is +58 MiB; NCCL's communicator alone was ~1 GiB).
TP_COMM = os.environ.get("TORPOR_TEST_TP_COMM", "nccl")  # the engines' EngineConfig.tp_comm
ASLEEP_OVER_BARE_MAX_MIB = 64 if TP_COMM == "torpor" else 3072
TINY = dict(device="cuda:0", max_model_len=256, max_num_seqs=16, block_size=16, num_kv_blocks=256)
# 64 requests of up to 256 prompt + 32 output tokens, all in one batch; a fixed KV size, the same for
# TP=1 and TP=2, so both schedule identically (no profiling: faster, and the memory figures stay small).
BIG = dict(device="cuda:0", max_model_len=512, max_num_seqs=64, block_size=16, num_kv_blocks=2048)
NUM_REQUESTS, MAX_PROMPT, MAX_TOKENS = 64, 256, 32
RESULTS: dict = {}


def say(line: str) -> None:
    print(line, flush=True)


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def greedy_requests(vocab_size: int, num: int, max_prompt: int, max_tokens: int) -> list:
    """`fixed_requests` prompts, all greedy, top-2 logprobs (the gap) and prompt logprobs."""
    return [(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, prompt_logprobs=1,
                                    ignore_eos=True))
            for prompt, _ in fixed_requests(num, vocab_size, seed=1, max_prompt=max_prompt, max_tokens=max_tokens)]


def compare_greedy(reference, outputs) -> dict:
    """TP=2 outputs against TP=1's (see the module docstring); the figures and what breaks the rules."""
    stats = dict(requests=len(reference), equal=0, max_prompt_diff=0.0, mean_prompt_diff=0.0, max_token_diff=0.0,
                 flips=[], problems=[])
    prompt_diffs = []
    for i, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        assert out.prompt_token_ids == ref.prompt_token_ids
        for pos in range(1, len(ref.prompt_token_ids)):
            token = ref.prompt_token_ids[pos]
            diff = abs(ref.prompt_logprobs[pos][token] - out.prompt_logprobs[pos][token])
            prompt_diffs.append(diff)
            stats["max_prompt_diff"] = max(stats["max_prompt_diff"], diff)
            if diff >= PROMPT_LOGPROB_TOL:
                stats["problems"].append(f"request {i} prompt position {pos}: logprob differs by {diff:.3f}")
        a, b = ref.outputs[0], out.outputs[0]
        stats["equal"] += a.token_ids == b.token_ids
        for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                top = sorted(a.logprobs[k].values(), reverse=True)
                gap = top[0] - top[1]
                stats["flips"].append(dict(request=i, position=k, tp1_top2_gap=gap))
                if gap >= FLIP_GAP:
                    stats["problems"].append(f"request {i} token {k}: {x} -> {y} although TP=1's top-2 gap is "
                                             f"{gap:.3f}")
                break
            diff = abs(a.logprobs[k][x] - b.logprobs[k][x])
            stats["max_token_diff"] = max(stats["max_token_diff"], diff)
            if diff >= TOKEN_LOGPROB_TOL:
                stats["problems"].append(f"request {i} token {k}: logprob differs by {diff:.3f}")
    stats["mean_prompt_diff"] = sum(prompt_diffs) / max(1, len(prompt_diffs))
    if stats["mean_prompt_diff"] >= PROMPT_LOGPROB_MEAN_TOL:
        stats["problems"].append(f"prompt logprobs differ by {stats['mean_prompt_diff']:.4f} on average")
    return stats


def check_greedy(stats: dict, label: str) -> None:
    flips = ", ".join(f"r{f['request']}@{f['position']} (gap {f['tp1_top2_gap']:.3f})" for f in stats["flips"])
    say(f"{label}: {stats['equal']}/{stats['requests']} requests equal to TP=1; |prompt logprob diff| max "
        f"{stats['max_prompt_diff']:.4f}, mean {stats['mean_prompt_diff']:.4f}; max |token logprob diff| "
        f"{stats['max_token_diff']:.4f}; first differences (request@token, TP=1's top-2 gap) at {flips or 'none'}")
    assert stats["problems"] == [], stats["problems"][:10]
    assert stats["equal"] >= MIN_EQUAL_FRACTION * stats["requests"]


def rank_devices(llm) -> list[dict]:
    return llm.memory_usage()["ranks"]


def check_placement(llm) -> list[dict]:
    """Rank r on cuda:r in its own process, CUDA graphs captured on every rank."""
    ranks = rank_devices(llm)
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    assert ranks[0]["pid"] == os.getpid() and ranks[1]["pid"] != os.getpid()
    assert [r["cuda_graphs"] for r in ranks] == [len(llm.config.cuda_graph_batch_sizes)] * 2
    return ranks


def write_results() -> None:
    folder = os.environ.get("TORPOR_GPU_RESULTS_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "tensor-parallel.json").write_text(json.dumps(RESULTS, indent=1, default=str))


# ---- 1. the tiny model: does NCCL + graph capture work at all ---------------------------------------
def test_tiny_model_starts_on_two_gpus_matches_one_and_sleeps_exactly():
    path = str(default_model_path())
    one = LLM(path, **TINY)
    requests = greedy_requests(one.engine.vocab_size, 12, max_prompt=48, max_tokens=GREEDY_TOKENS)
    reference = run_round(one, requests)
    one.close()
    del one
    release()
    start = time.perf_counter()
    two = LLM(path, tensor_parallel_size=2, tp_comm=TP_COMM, **TINY)
    start_s = time.perf_counter() - start
    worker = two.engine.executor.processes[0]
    try:
        ranks = check_placement(two)
        say(f"tiny TP=2: started in {start_s:.1f} s; " + "; ".join(
            f"rank {r['rank']} pid {r['pid']} on {r['device']}, {r['cuda_graphs']} graphs, "
            f"{r['device_used_bytes'] / MiB:.0f} MiB in use" for r in ranks))
        stats = compare_greedy(reference, run_round(two, requests))
        check_greedy(stats, "tiny TP=2")
        harness = run_harness(two, fixed_requests(8, two.engine.vocab_size, max_prompt=32, max_tokens=8),
                              log=lambda line: say(f"tiny TP=2 harness: {line}"))
        assert [s.name for s in harness if s.mismatches] == []
    finally:
        start = time.perf_counter()
        two.close()
        close_s = time.perf_counter() - start
    say(f"tiny TP=2: closed in {close_s:.1f} s, worker exit code {worker.exitcode}")
    RESULTS["tiny"] = dict(start_s=start_s, close_s=close_s, equal=stats["equal"], requests=stats["requests"],
                           max_prompt_diff=stats["max_prompt_diff"], max_token_diff=stats["max_token_diff"])
    write_results()
    assert worker.exitcode == 0  # it met rank 0 in the collective teardown, nobody was killed
    assert not torch.distributed.is_initialized()
    del two
    release()


# ---- 2. qwen3-8b, one TP=2 engine for the module ----------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_8b() -> str:
    from torpor.synthetic import cached_model_path

    return str(cached_model_path("qwen3-8b"))


@pytest.fixture(scope="module")
def bare() -> dict:
    """A fresh process's CUDA context alone on GPU 1 (nothing else there yet): MiB in use; and the
    devices' UUIDs (for NVML), read there so the test process touches no other GPU than its own."""
    script = ("import json, torch; torch.zeros(1, device='cuda:1'); free, total = torch.cuda.mem_get_info(1); "
              "print(json.dumps(dict(bare_mib=(total - free) / 2**20, "
              "uuids=[str(getattr(torch.cuda.get_device_properties(i), 'uuid', '')) for i in range(2)])))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    say(f"bare CUDA context (fresh process, GPU 1): {result['bare_mib']:.0f} MiB in use")
    RESULTS["bare_mib"] = result["bare_mib"]
    return result


@pytest.fixture(scope="module")
def tp2(qwen3_8b, bare):
    """The TP=2 engine (CUDA graphs) and its greedy outputs, made first (before any sleep)."""
    release()
    start = time.perf_counter()
    llm = LLM(qwen3_8b, tensor_parallel_size=2, tp_comm=TP_COMM, **BIG)
    start_s = time.perf_counter() - start
    ranks = check_placement(llm)
    say(f"qwen3-8b TP=2: started in {start_s:.1f} s; " + "; ".join(
        f"rank {r['rank']} on {r['device']}: {r['device_used_bytes'] / MiB:.0f} MiB in use, weights "
        f"{r['tags']['weights']['resident_bytes'] / MiB:.0f} MiB, "
        f"KV {r['tags']['kv_cache']['resident_bytes'] / MiB:.0f} MiB, {r['cuda_graphs']} graphs" for r in ranks))
    requests = greedy_requests(llm.engine.vocab_size, NUM_REQUESTS, MAX_PROMPT, GREEDY_TOKENS)
    start = time.perf_counter()
    greedy = run_round(llm, requests)
    RESULTS["qwen3_8b_tp2"] = dict(start_s=start_s, greedy_round_s=time.perf_counter() - start)
    state = SimpleNamespace(llm=llm, requests=requests, greedy=greedy, closed=False)

    def close() -> None:
        if not state.closed:
            state.closed = True
            state.llm.close()
            state.llm = None
            release()

    state.close = close
    yield state
    close()
    write_results()


def open_engine(tp2):
    if tp2.closed:
        pytest.fail("the TP=2 engine was closed by an earlier test (run the file in order)")
    return tp2.llm


def nvml_per_gpu(uuids: list[str]) -> dict | None:
    """NVML's used MiB and compute processes per GPU (CUDA index order), or None without nvidia-ml-py."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # not installed, or no NVML library
        say(f"NVML not available ({type(e).__name__}): per-GPU figures from the ranks only")
        return None
    try:
        result = {}
        for index, uuid in enumerate(uuids):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except pynvml.NVMLError:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                processes = [(p.pid, (p.usedGpuMemory or 0) / MiB)
                             for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            except pynvml.NVMLError:
                processes = None
            result[index] = dict(used_mib=pynvml.nvmlDeviceGetMemoryInfo(handle).used / MiB, processes=processes)
        return result
    finally:
        pynvml.nvmlShutdown()


def reading(llm, uuids: list[str]) -> dict:
    """Per GPU: MiB in use as the rank on it reads it, and NVML's view when available."""
    ranks = rank_devices(llm)
    per_gpu = {int(r["device"].partition(":")[2]): dict(rank_mib=r["device_used_bytes"] / MiB,
                                                        tags_resident_mib=sum(t["resident_bytes"] for t in
                                                                              r["tags"].values()) / MiB,
                                                        pid=r["pid"])
               for r in ranks}
    nvml = nvml_per_gpu(uuids)
    for gpu, figures in (nvml or {}).items():
        per_gpu[gpu]["nvml_used_mib"] = figures["used_mib"]
        per_gpu[gpu]["nvml_processes"] = figures["processes"]
    return per_gpu


def test_asleep_memory_per_gpu_against_a_bare_context(tp2, bare):
    llm, uuids, bare_mib = open_engine(tp2), bare["uuids"], bare["bare_mib"]
    rows = {}
    for level in (1, 2):
        awake = reading(llm, uuids)
        start = time.perf_counter()
        llm.sleep(level)
        sleep_s = time.perf_counter() - start
        asleep = reading(llm, uuids)
        start = time.perf_counter()
        if level == 2:
            llm.wake_up(["weights"])
            llm.reload_weights()
        llm.wake_up()
        wake_s = time.perf_counter() - start
        for gpu in (0, 1):
            row = dict(awake_mib=awake[gpu]["rank_mib"], asleep_mib=asleep[gpu]["rank_mib"], bare_mib=bare_mib,
                       asleep_over_bare_mib=asleep[gpu]["rank_mib"] - bare_mib, sleep_s=sleep_s, wake_s=wake_s,
                       asleep_tags_resident_mib=asleep[gpu]["tags_resident_mib"], pid=asleep[gpu]["pid"],
                       nvml_awake_mib=awake[gpu].get("nvml_used_mib"), nvml_asleep_mib=asleep[gpu].get("nvml_used_mib"),
                       nvml_processes_asleep=asleep[gpu].get("nvml_processes"))
            rows[f"level{level}_gpu{gpu}"] = row
            nvml = "" if row["nvml_asleep_mib"] is None else (
                f"; NVML: awake {row['nvml_awake_mib']:.0f}, asleep {row['nvml_asleep_mib']:.0f} MiB, processes "
                f"{row['nvml_processes_asleep']}")
            say(f"qwen3-8b TP=2 level {level} GPU {gpu} (rank {gpu}, pid {row['pid']}): awake {row['awake_mib']:.0f} "
                f"MiB, asleep {row['asleep_mib']:.0f} MiB, bare {bare_mib:.0f} MiB, asleep - bare "
                f"{row['asleep_over_bare_mib']:+.0f} MiB; sleep {sleep_s:.2f} s, wake {wake_s:.2f} s{nvml}")
    RESULTS["qwen3_8b_tp2_memory"] = rows
    write_results()
    assert differences(tp2.greedy, run_round(llm, tp2.requests)) == []  # the same graphs replay after wakes
    for name, row in rows.items():
        assert row["asleep_tags_resident_mib"] == 0, name  # every rank released every tag
        assert row["asleep_over_bare_mib"] < ASLEEP_OVER_BARE_MAX_MIB, (
            f"{name}: {row['asleep_over_bare_mib']:.0f} MiB above a bare context while asleep (another "
            "process on this GPU? run this file alone)")
        processes = row["nvml_processes_asleep"]
        if processes:  # NVML sees the processes: one per GPU, no context of one rank on the other's GPU
            assert len(processes) == 1, f"{name}: processes on this GPU: {processes}"


def test_bit_exact_sleep_harness_at_tp2(tp2):
    llm = open_engine(tp2)
    requests = fixed_requests(NUM_REQUESTS, llm.engine.vocab_size, max_prompt=MAX_PROMPT, max_tokens=MAX_TOKENS)
    start = time.perf_counter()
    results = run_harness(llm, requests, log=lambda line: say(f"qwen3-8b TP=2 harness: {line}"))
    RESULTS["qwen3_8b_tp2_harness"] = [dict(name=s.name, mismatches=s.mismatches, sleep_s=s.sleep_s, wake_s=s.wake_s,
                                            asleep_rank0_mib=s.asleep_bytes / MiB) for s in results]
    RESULTS["qwen3_8b_tp2_harness_s"] = time.perf_counter() - start
    write_results()
    assert len(results) == 6
    assert {s.name: s.mismatches for s in results} == {s.name: 0 for s in results}


def test_greedy_outputs_match_one_gpu(tp2, qwen3_8b):
    tp2.close()  # one process group per process, and GPU 0's memory back for the TP=1 engine
    start = time.perf_counter()
    one = LLM(qwen3_8b, **BIG)
    try:
        reference = run_round(one, tp2.requests)
    finally:
        one.close()
    say(f"qwen3-8b TP=1 reference in {time.perf_counter() - start:.1f} s")
    stats = compare_greedy(reference, tp2.greedy)
    RESULTS["qwen3_8b_tp2_vs_tp1"] = {k: v for k, v in stats.items() if k != "problems"} | dict(
        problems=stats["problems"][:20], tolerances=dict(
            prompt=PROMPT_LOGPROB_TOL, prompt_mean=PROMPT_LOGPROB_MEAN_TOL, token=TOKEN_LOGPROB_TOL, flip_gap=FLIP_GAP,
            min_equal=MIN_EQUAL_FRACTION, greedy_tokens=GREEDY_TOKENS))
    write_results()
    check_greedy(stats, "qwen3-8b TP=2")
