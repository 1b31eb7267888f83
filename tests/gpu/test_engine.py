"""`LLM` on CUDA: CUDA graphs vs eager, against transformers, memory tags, KV-cache sizing, sleep/wake."""

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

MiB = 1 << 20
SMALL = dict(device="cuda", max_model_len=256, max_num_seqs=16, block_size=16, num_kv_blocks=256)
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5, prompt_logprobs=3),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=1.0, top_k=10, seed=4, max_tokens=50, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-models")
    return {dtype: make_model("tiny", root / dtype, dtype=dtype, progress=False) for dtype in ("bfloat16", "float32")}


@pytest.fixture(autouse=True)
def release_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def utilization(extra: float) -> float:
    """A gpu_memory_utilization that leaves the engine `extra` of the device beyond what is in use (the
    cache of earlier tests emptied first: the engine's start-up empties it too)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / total + extra, 3)


def prompts(lengths=(3, 17, 40, 9, 100), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def summary(outputs):
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graphs_match_eager_exactly(checkpoints, dtype):
    path = str(checkpoints[dtype])
    graphs = LLM(path, **SMALL)
    assert graphs.engine.executor.driver.runner.graphs is not None
    with_graphs = summary(graphs.generate(prompts(), PARAMS))  # 5 sequences: the batch-8 graph, 3 padded rows
    with_graphs += summary(graphs.generate(prompts((7,), seed=1), PARAMS[:1]))  # the batch-1 graph
    del graphs
    eager = LLM(path, enforce_eager=True, **SMALL)
    assert eager.engine.executor.driver.runner.graphs is None
    expected = summary(eager.generate(prompts(), PARAMS)) + summary(eager.generate(prompts((7,), seed=1), PARAMS[:1]))
    assert with_graphs == expected


def test_startup_phases_time_the_graph_capture(checkpoints):
    """`LLM.startup_phases` says where the start-up goes (what `torpor bench sleep` prints): the capture, and its
    eager warm-up inside it."""
    llm = LLM(str(checkpoints["bfloat16"]), **SMALL)
    phases = llm.startup_phases
    assert 0 < phases["cuda_graph_warm_up"] <= phases["cuda_graph_capture"] < phases["total"]
    del llm


def test_greedy_matches_transformers_on_gpu(checkpoints):
    transformers = pytest.importorskip("transformers")
    path = checkpoints["float32"]
    llm = LLM(str(path), **SMALL)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, out in zip(prompts(), llm.generate(prompts(), params), strict=True):
        ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_every_tag_holds_its_buffers_and_nothing_escapes(checkpoints):
    from torpor.memory import MemoryManager

    memory = MemoryManager("cuda")
    untagged_before = memory.audit().untagged_bytes  # earlier tests' cuBLAS workspaces, HF caches, ...
    options = {**SMALL, "num_kv_blocks": None, "gpu_memory_utilization": utilization(0.05)}  # profiled
    llm = LLM(str(checkpoints["bfloat16"]), memory=memory, **options)
    runner = llm.engine.executor.driver.runner
    usage = memory.usage()
    for tag in ("weights", "kv_cache", "runtime", "workspace", "cuda_graph"):
        assert usage[tag].allocated_bytes > 0 or usage[tag].reserved_bytes > 0, tag
    backend = memory._backend
    assert {backend.find(p.data_ptr()).tag for p in runner.model.parameters()} == {"weights"}
    assert backend.find(runner.kv_cache.data_ptr()).tag == "kv_cache"
    for t in (runner.buffers.tokens, runner.buffers.lens_tables, runner.buffers.hidden, runner.sampler._inputs):
        assert backend.find(t.data_ptr()).tag == "runtime"
    assert backend.find(runner.backend.workspace.data_ptr()).tag == "workspace"
    assert backend.find(runner.engine_stream.gemm_workspace.data_ptr()).tag == "workspace"
    # Left untagged on purpose: the graphs' RNG seed and offset (a few bytes made by the first capture of
    # the process, in one 2 MiB segment). The profiling step must not leave anything behind.
    untagged = memory.audit().untagged_bytes - untagged_before
    print(f"untagged after start-up: {untagged / MiB:.1f} MiB more than before")
    assert untagged <= 2 * MiB
    first = summary(llm.generate(prompts(), PARAMS))
    for tag in memory.tags():
        memory.seal(tag)
    again = summary(llm.generate(prompts(), PARAMS))
    assert memory.audit().late_allocations == ()
    assert again == first
    memory.sleep({"weights": "offload", "kv_cache": "discard", "runtime": "offload", "workspace": "discard",
                  "cuda_graph": "offload"})
    memory.wake()
    llm.reset_prefix_cache()  # the KV cache came back zeroed behind the engine's back: its cached blocks are gone
    assert summary(llm.generate(prompts(), PARAMS)) == first  # the same graphs replay after the wake
    del llm, runner
    memory.close()


def test_kv_cache_is_sized_from_gpu_memory_utilization(checkpoints):
    path = str(checkpoints["bfloat16"])
    total = torch.cuda.mem_get_info()[1]
    # 2% of the device beyond what is in use: the KV cache is budget-limited. Start-up takes a fixed part
    # of it (the profiled step's peak, the GEMM workspace, kernel code; ~0.8 GB on an H200).
    budget = utilization(0.02)
    # Every sequence at max_model_len would need 8 GiB of this model's KV cache: more than the budget.
    llm = LLM(path, device="cuda", max_model_len=4096, max_num_seqs=4096, enforce_eager=True,
              gpu_memory_utilization=budget)
    config, kv_bytes = llm.config, llm.engine.executor.driver.runner.kv_cache.nbytes
    assert config.num_kv_blocks < config.max_num_seqs * config.max_num_blocks_per_seq
    assert kv_bytes > 0.01 * total  # most of the 2% went to the cache
    assert total - torch.cuda.mem_get_info()[0] <= budget * total  # and the engine stayed within its budget
    outputs = llm.generate(prompts(), PARAMS)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in PARAMS]
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    # a generous budget: capped at every sequence at max_model_len (more blocks would never be used)
    llm = LLM(path, device="cuda", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=utilization(0.05))
    assert llm.config.num_kv_blocks == 8 * 256 // 16


def test_a_restart_reads_the_profiled_step_back_and_sizes_the_cache_alike(checkpoints, tmp_path):
    """Two start-ups in new processes with the same model and options: the first measures the worst-case step,
    the second reads it back (profile_cache.py) and gets the same KV cache within the kernel code it counts
    in advance, inside the same budget."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    budget = utilization(0.02)
    code = textwrap.dedent(f"""
        import json, time, torch
        from torpor.engine import LLM
        start = time.perf_counter()
        llm = LLM({str(checkpoints["bfloat16"])!r}, device="cuda", max_model_len=4096, max_num_seqs=4096,
                  enforce_eager=True, gpu_memory_utilization={budget})
        free, total = torch.cuda.mem_get_info()
        print(json.dumps(dict(blocks=llm.config.num_kv_blocks, used=total - free, total=total,
                              seconds=time.perf_counter() - start)))
    """)
    env = {**os.environ, "TORPOR_CACHE": str(tmp_path), "TORPOR_DEBUG": "1"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert "from an earlier start-up" not in runs[0].stderr and "from an earlier start-up" in runs[1].stderr
    print(f"\nKV blocks measuring {first['blocks']}, reading back {second['blocks']}; start-up {first['seconds']:.2f} "
          f"s vs {second['seconds']:.2f} s")
    assert 0.9 * first["blocks"] <= second["blocks"] <= first["blocks"] * 1.01
    assert second["used"] <= budget * second["total"]
