"""The one-node collectives (tensor_exchange.py) on two GPUs, in two real processes: all-reduce, gather and
broadcast against the expected values, inside a CUDA graph, across a release and a new mapping of the buffer
(same addresses: the graph replays), and the device memory the buffer gives back while released."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)


def _rank_main(rank: int, port: int, results) -> None:
    try:
        results[rank] = _checks(rank, port)
    except BaseException:
        results[rank] = {"error": traceback.format_exc()}


def _checks(rank: int, port: int) -> dict:
    from torpor.engine import distributed as d

    device = torch.device("cuda", rank)
    store = d.rendezvous_store(port, 2, rank == 0, 60)
    group = d.TPGroup.join(rank, 2, store, device, comm="torpor", timeout_s=60)
    assert group.exchange is not None, 'comm="torpor" makes the exchange'
    with group.active():
        return _collectives(group, rank, device)


def _collectives(group, rank: int, device: torch.device) -> dict:
    from torpor.engine import distributed as d

    out: dict = {}
    g = torch.Generator(device=device).manual_seed(rank)
    peer = torch.Generator(device=device).manual_seed(1 - rank)
    for numel, dtype in ((7, torch.float32), (4096 * 256, torch.bfloat16), (3_000_000, torch.float32)):
        mine = torch.randn(numel, generator=g, device=device).to(dtype)
        theirs = torch.randn(numel, generator=peer, device=device).to(dtype)
        expected = (mine.float() + theirs.float()).to(dtype)  # fp32 sum, one rounding, either order
        out[f"sum{numel}"] = bool(torch.equal(d.all_reduce(mine.clone()), expected))
    x = torch.randn(5, 40_000, generator=g, device=device)
    y = torch.randn(5, 40_000, generator=peer, device=device)
    pair = (x, y) if rank == 0 else (y, x)
    out["gather"] = bool(torch.equal(d.gather_last_dim(x), torch.cat(pair, dim=-1)))
    out["broadcast"] = bool(torch.equal(d.broadcast_from_rank0(x.clone()), pair[0]))
    # A graph captured on the buffer replays after a release and a new mapping at the same addresses.
    stream = torch.cuda.Stream(device)
    z = torch.randn(256, 4096, generator=g, device=device, dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        d.all_reduce(z.clone())  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        buffer = z.clone()
        with torch.cuda.graph(graph, stream=stream):
            d.all_reduce(buffer)
    torch.cuda.synchronize(device)
    buffer.copy_(z)
    graph.replay()
    torch.cuda.synchronize(device)
    first = buffer.clone()
    free_mapped = torch.cuda.mem_get_info(device)[0]
    group.release_exchange()
    group.all_ok(True)  # a barrier: a slot's memory goes back once every rank released it
    out["released_mib"] = (torch.cuda.mem_get_info(device)[0] - free_mapped) / 2**20
    group.restore_exchange()
    buffer.copy_(z)
    graph.replay()
    torch.cuda.synchronize(device)
    out["graph_after_remap"] = bool(torch.equal(buffer, first))
    group.check_exchange()
    assert group.shutdown(), "the group left within its timeout"
    return out


def test_collectives_on_two_gpus_through_the_exchange_buffer():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)  # only to pick a free port
    port = store.port
    del store
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    processes = [ctx.Process(target=_rank_main, args=(rank, port, results)) for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(240)
    for rank in range(2):
        result = dict(results.get(rank, {"error": f"rank {rank} gave no result (exit {processes[rank].exitcode})"}))
        print(f"rank {rank}: {result}")
        assert "error" not in result, result["error"]
        assert all(v for k, v in result.items() if k != "released_mib"), result
        assert result["released_mib"] >= 6  # its own 8 MiB slot (a peer's mapping holds no memory here)
