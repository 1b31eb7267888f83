"""Weights from a trainer process on CUDA: IPC buckets from another process into an `LLM` (the answers of the
new weights, bit for bit; the trainer's memory is released by the engine after the copy), and with 2 GPUs
the NCCL update group (trainer on GPU 1, engine on GPU 0)."""

import threading

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from trainer_process import start_trainer, stderr_of, tiny_checkpoints  # noqa: E402

from torpor.engine import LLM, SamplingParams  # noqa: E402
from torpor.rl.engine_process import free_port  # noqa: E402

ENGINE = dict(max_model_len=256, max_num_seqs=8, block_size=16, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("weights"))


def answers(llm) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY)]


IPC_TRAINER = """
    import sys, torch
    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.rl import bucket_named_tensors, serialize
    named = [(n, t.cuda()) for n, t in iter_checkpoint(sys.argv[1])]
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    buckets = list(bucket_named_tensors(named, 200_000))
    print(len(buckets), flush=True)
    for b in buckets:
        print(serialize(b.payload()), flush=True)
    sys.stdin.readline()  # the engine has copied every bucket
    del buckets, b
    torch.cuda.ipc_collect()  # blocks the engine still maps stay allocated here
    print(torch.cuda.memory_allocated() - baseline, flush=True)
"""


def test_ipc_buckets_from_another_process(checkpoints):
    reference = LLM(checkpoints[1], device="cuda", **ENGINE)
    want = answers(reference)
    reference.close()
    del reference
    llm = LLM(checkpoints[0], device="cuda", **ENGINE)
    assert answers(llm) != want
    trainer = start_trainer(IPC_TRAINER, checkpoints[1])
    try:
        count = int(trainer.stdout.readline())
        payloads = [trainer.stdout.readline().strip() for _ in range(count)]
        assert count > 1 and all(payloads), stderr_of(trainer)
        llm.sleep(2)
        llm.wake_up(["weights"])
        for payload in payloads:
            llm.update_weights_from_tensor(serialized_named_tensors=[payload], load_format="flattened_bucket")
        llm.wake_up(["kv_cache"])
        trainer.stdin.write("done\n")
        trainer.stdin.flush()
        left = int(trainer.stdout.readline())
    finally:
        trainer.stdin.close()
        trainer.wait(120)
    assert left == 0, "the engine still maps the trainer's buckets after the copy"
    assert answers(llm) == want  # the pushed weights serve, bit for bit as if loaded from disk


GROUP_TRAINER = """
    import os, sys, torch
    sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
    from sglang_trainer import broadcast_all, trainer_group
    from torpor.engine.weights.loader import iter_checkpoint
    torch.cuda.set_device(1)
    named = [(n, t.to("cuda:1")) for n, t in iter_checkpoint(sys.argv[1])]
    group = trainer_group(int(sys.argv[2]), 2, "test", timeout_s=120, backend="nccl")  # as SGLang's users do
    sys.stdin.readline()  # the engine asks for the tensors
    count = len(named) if sys.argv[3] == "all" else int(sys.argv[3])
    broadcast_all(group, [t for _, t in named[:count]])
    torch.cuda.synchronize()
    print("sent", flush=True)
    if count < len(named):  # a trainer that dies mid-update: no clean-up, no goodbye
        import os
        os._exit(1)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_update_group_across_gpus(checkpoints):
    from torpor.engine.weights.loader import iter_checkpoint

    reference = LLM(checkpoints[1], device="cuda:0", **ENGINE)
    want = answers(reference)
    reference.close()
    del reference
    llm = LLM(checkpoints[0], device="cuda:0", **ENGINE)
    port = free_port()
    trainer = start_trainer(GROUP_TRAINER, checkpoints[1], str(port), "all")
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, "test", "nccl", timeout=120)
        named = list(iter_checkpoint(checkpoints[1]))
        result = {}
        receive = threading.Thread(target=lambda: result.setdefault("count", llm.update_weights_from_distributed(
            [n for n, _ in named], ["bfloat16"] * len(named), [list(t.shape) for _, t in named], "test")))
        receive.start()
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        receive.join(120)
        assert trainer.stdout.readline().strip() == "sent", stderr_of(trainer)
        assert result.get("count", 0) > 0
        llm.destroy_weights_update_group("test")
    finally:
        trainer.stdin.close()
        trainer.wait(120)
    assert answers(llm) == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_trainer_dying_mid_nccl_update_leaves_the_engine_serving(checkpoints):
    """The trainer broadcasts half the tensors and exits: the receive gives up at the group's timeout (it polls the
    last broadcast instead of a CUDA synchronize), aborts the communicator, and raises; the engine process lives
    on (the update group's watchdog only cleans up: PyTorch's default would end this pytest process) and answers
    with its previous weights, bit for bit."""
    import time

    from torpor.engine.weights.loader import iter_checkpoint
    from torpor.engine.weights.transport import WeightTransferError

    llm = LLM(checkpoints[0], device="cuda:0", **ENGINE)
    before = answers(llm)
    port = free_port()
    named = list(iter_checkpoint(checkpoints[1]))
    trainer = start_trainer(GROUP_TRAINER, checkpoints[1], str(port), str(len(named) // 2))
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, "test", "nccl", timeout=20)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        start = time.monotonic()
        with pytest.raises(WeightTransferError, match="the previous weights stay"):
            llm.update_weights_from_distributed([n for n, _ in named], ["bfloat16"] * len(named),
                                                [list(t.shape) for _, t in named], "test")
        waited = time.monotonic() - start
    finally:
        trainer.stdin.close()
        trainer.wait(120)
    assert trainer.returncode == 1, stderr_of(trainer)
    # At the group's timeout (20 s), or at the watchdog's (30 s later) if NCCL's enqueue itself waited for the GPU.
    assert waited < 80, f"the receive waited {waited:.0f} s for a trainer gone (timeout 20 s)"
    assert answers(llm) == before  # nothing was written
