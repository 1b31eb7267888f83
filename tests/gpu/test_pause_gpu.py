"""pause_generation on CUDA (tiny bf16 model, CUDA graphs): a request paused with "keep" across a weight update is
the old weights' answer before it and, with clear_cache, the new weights' continuation of the same tokens after it
(span by span, vLLM's `weight_versions`); without clear_cache it keeps its blocks; pause / resume of 512 running
requests take milliseconds (printed)."""

import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.engine.outputs import WeightVersionSpan  # noqa: E402
from torpor.engine.sequence import SequenceStatus  # noqa: E402
from torpor.engine.weights.loader import iter_checkpoint  # noqa: E402
from torpor.synthetic import make_model  # noqa: E402

ENGINE = dict(device="cuda", max_model_len=256, max_num_seqs=512, block_size=16)
PROMPT = [5, 17, 300, 42, 7, 9]
N, K = 40, 9


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("pause-gpu")
    return tuple(str(make_model("tiny", root / f"seed{s}", seed=s, dtype="bfloat16", progress=False)) for s in (0, 1))


def run_until(engine, request_id: str, num_tokens: int) -> None:
    seq = engine.scheduler.samples(request_id)[0]
    while seq.num_output_tokens < num_tokens:
        engine.step()


def finish(engine) -> dict:
    done = {}
    while not engine.is_finished() or engine.has_pending_outputs():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


@pytest.mark.parametrize("clear_cache", [True, False])
def test_keep_across_a_weight_update(paths, clear_cache):
    old, new = paths
    expected_old = LLM(old, **ENGINE).generate([PROMPT], greedy(N), use_tqdm=False)[0].outputs[0].token_ids
    engine = LLM(old, **ENGINE).engine
    engine.add_request(PROMPT, greedy(N), "a")
    run_until(engine, "a", K)
    seq = engine.scheduler.samples("a")[0]
    blocks = list(seq.block_table)
    engine.pause_generation("keep", clear_cache)
    engine.update_weights(list(iter_checkpoint(new)))
    engine.update_weight_version("step-1")
    if clear_cache:
        assert seq.status is SequenceStatus.WAITING and seq.block_table == []
    else:
        assert seq.status is SequenceStatus.RUNNING and seq.block_table == blocks
    engine.resume_generation()
    out = finish(engine)["a"].outputs[0]
    assert out.weight_versions == [WeightVersionSpan("default", 0, K), WeightVersionSpan("step-1", K, N)]
    assert out.token_ids[:K] == expected_old[:K]
    if clear_cache:
        continued = LLM(new, **ENGINE).generate([PROMPT + out.token_ids[:K]], greedy(N - K), use_tqdm=False)
        assert out.token_ids[K:] == continued[0].outputs[0].token_ids


def test_pause_and_resume_of_512_running_requests_take_milliseconds(paths):
    engine = LLM(paths[0], **ENGINE).engine
    for i in range(512):
        engine.add_request([1 + i % 500, 2 + i % 300, 3], greedy(200), f"r{i}")
    while len(engine.scheduler.running) < 512:
        engine.step()
    engine.step()
    times = {}
    for mode, clear_cache in (("keep", False), ("keep", True)):
        start = time.perf_counter()
        engine.pause_generation(mode, clear_cache)
        middle = time.perf_counter()
        engine.resume_generation()
        times[(mode, clear_cache)] = ((middle - start) * 1e3, (time.perf_counter() - middle) * 1e3)
        while len(engine.scheduler.running) < 512:  # retracted ones prefill again
            engine.step()
    print(f"\npause / resume of 512 running requests, ms: {times}")
    assert all(pause < 5 and resume < 5 for pause, resume in times.values())
    engine.abort_requests(None)
