"""Tensor-parallel state of this process (its rank, the group size) and the few collectives the layers use.

One process per rank; the default process group holds them all. On CPU it is gloo and runs the
collectives. On GPU it is NCCL by default (its communicator's ~1 GiB per GPU stays while the engine sleeps);
with `TORPOR_TP_COMM=torpor` the collectives go through a `TensorExchange` (a symmetric buffer every rank maps
and that sleeps with the engine, see tensor_exchange.py) and the process group is gloo, for control only: no
NCCL communicator exists. The exchange is opt-in until it has run on GPUs. Without `init_tensor_parallel`
the process is rank 0 of 1 and every collective is the identity, so a single-device engine never touches
torch.distributed.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from torpor.env import Env

logger = logging.getLogger("torpor.engine")
_rank, _size = 0, 1
_device: torch.device | None = None  # this rank's device while in a group
_exchange = None  # TensorExchange: the collectives on GPU (None on CPU and with TORPOR_TP_COMM=nccl)


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def rendezvous_store(port: int, size: int, is_rank0: bool, timeout_s: float) -> dist.TCPStore:
    """The ranks' meeting point on this host: rank 0 hosts it (`port` 0 picks a free port, read back from
    `.port`) and returns at once; the workers connect to rank 0's port."""
    return dist.TCPStore("127.0.0.1", port, size, is_rank0, timedelta(seconds=timeout_s), wait_for_workers=False)


def check_in(store: dist.TCPStore, rank: int) -> None:
    """A worker: tell rank 0 this process started and reached the store (see `checked_in`)."""
    store.set(f"torpor/up/{rank}", "1")


def checked_in(store: dist.TCPStore, ranks: range) -> bool:
    """Rank 0: whether every worker of `ranks` has checked in."""
    return store.check([f"torpor/up/{rank}" for rank in ranks])


def init_tensor_parallel(rank: int, size: int, store: dist.Store, device: torch.device,
                         timeout_s: float = 120.0) -> None:
    """Join the group of `size` ranks that meet at `store` (see `rendezvous_store`).

    On CUDA the rank's device becomes this thread's current device first, so nothing ever makes a context
    on another device (cuda:0 by default), and the exchange buffer (or NCCL's communicator: `device_id`,
    eager init) is made now, before any memory tag scope and before any CUDA graph capture."""
    global _rank, _size, _device, _exchange
    nccl = device.type == "cuda" and Env.read().tp_comm == "nccl"
    kwargs = {}
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"tensor parallelism needs an indexed CUDA device (cuda:N), got {device}")
        torch.cuda.set_device(device)
        if nccl:
            kwargs["device_id"] = device
    dist.init_process_group("nccl" if nccl else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    _rank, _size, _device = rank, size, device
    if device.type == "cuda" and not nccl:
        from torpor.engine.symmetric_memory import SymmetricMemory
        from torpor.engine.tensor_exchange import TensorExchange

        if rank == 0:
            store.set("torpor/group_key", f"{os.getpid()}-{secrets.token_hex(4)}")
        key = store.get("torpor/group_key").decode()
        _exchange = TensorExchange(SymmetricMemory(rank, size, device, key, all_ranks_ok,
                                                   timeout_s=min(60.0, timeout_s)))


def all_ranks_ok(ok: bool) -> bool:
    """A collective of the whole group: True if every rank passed ok=True (a barrier that also tells each rank
    whether the others succeeded). Over the default group on the CPU (gloo under `TORPOR_TP_COMM=torpor`)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def release_exchange() -> None:
    """Give the exchange buffer's device memory back (every rank, when the engine sleeps; the device idle)."""
    if _exchange is not None:
        _exchange.buffer.unmap()


def restore_exchange() -> None:
    """Map the exchange buffer again at the same addresses (every rank at once, when the engine wakes)."""
    if _exchange is not None:
        _exchange.buffer.map()


def check_exchange() -> None:
    """Raise if a collective of the exchange gave up waiting for a peer (call after a step)."""
    if _exchange is not None and _exchange.buffer.is_mapped:
        _exchange.check()


def shutdown_tensor_parallel(healthy: bool = True, timeout_s: float = 60.0) -> bool:
    """Leave the group (this process is rank 0 of 1 again). Returns False if the group could not be
    torn down within `timeout_s` (it is then left behind: this process cannot join another group).

    healthy: every rank is alive and leaves now too. NCCL's communicator teardown (finalize, destroy,
    even abort) is an intra-node collective: a rank leaving alone waits for the others. So the ranks
    meet in a barrier first (every backend, so gloo on CPU checks the same protocol), then destroy.
    Not healthy (a rank died or hangs): no barrier; NCCL's communicator is aborted instead."""
    global _rank, _size, _device, _exchange
    device = _device if _device is not None and _device.type == "cuda" else None
    _rank, _size, _device = 0, 1, None
    exchange, _exchange = _exchange, None
    if exchange is not None:  # local: a peer may be gone
        try:
            exchange.buffer.close()
        except Exception as e:  # the process group must still go: this process may join another
            logger.warning("tensor parallel: releasing the exchange buffer failed: %s", e)
    if not dist.is_initialized():
        return True
    nccl = dist.get_backend() == "nccl"

    def leave() -> None:
        if device is not None:
            torch.cuda.set_device(device)  # the rank's device (a new thread starts on cuda:0)
        if healthy:
            try:
                dist.barrier()
            except Exception:  # a peer went away after all (gloo notices): tear down as not healthy
                pass
            else:
                dist.destroy_process_group()
                return
        if nccl:
            dist.distributed_c10d._abort_process_group()  # also forgets the group, like destroy
        else:
            dist.destroy_process_group()  # gloo: local

    return _bounded(leave, timeout_s)


def abort_if_nccl() -> bool:
    """Abort this process's NCCL communicator (from any thread): collectives pending on it, or issued
    later, fail instead of waiting for a peer that is gone. gloo notices a dead peer by itself: no-op.
    Returns whether it aborted."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return False
    dist.distributed_c10d._abort_process_group()
    return True


def _bounded(fn, timeout_s: float) -> bool:
    """Run `fn` in a daemon thread; False if it did not finish in time (a teardown blocked by a peer)."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # reported below
            error.append(e)

    thread = threading.Thread(target=run, name="torpor-tp-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        warnings.warn(f"the tensor-parallel process group did not tear down within {timeout_s:.0f} s; it is "
                      "left behind (this process cannot start another tensor-parallel engine)", stacklevel=3)
        return False
    if error:
        warnings.warn(f"tearing down the tensor-parallel process group failed: {error[0]!r}", stacklevel=3)
        return False
    return True


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (the partial outputs of row-parallel layers)."""
    if _size > 1:
        if _exchange is not None:
            _exchange.all_reduce(x)
        else:
            dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on every rank -> [..., n * size], rank order (vocab-sharded logits)."""
    if _size == 1:
        return x
    if _exchange is not None:
        return _exchange.gather_last_dim(x)
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` of all ranks (e.g. the KV blocks that fit on every device). `device` is
    the rank's own: NCCL only moves CUDA tensors (every collective here runs on the rank's device;
    control travels through rank 0's pipes, never through the process group)."""
    if _size == 1:
        return value
    on_device = dist.get_backend() == "nccl"  # gloo reduces host tensors
    t = torch.tensor([value], dtype=torch.int64, device=device if on_device else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """`x` of rank 0 into `x` of every rank (same shape and dtype everywhere), in place."""
    if _size > 1:
        if _exchange is not None:
            _exchange.broadcast(x)
        else:
            dist.broadcast(x, src=0)
    return x


def shard_size(total: int, what: str) -> int:
    """`total` split over the ranks; a clear error when it does not divide."""
    if total % _size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({_size})")
    return total // _size


def check_divisible(model_config, size: int) -> None:
    """Raise before any process starts when the model cannot be split over `size` ranks."""
    m = model_config
    for what, total in (("num_attention_heads", m.num_attention_heads), ("num_key_value_heads", m.num_key_value_heads),
                        ("intermediate_size", m.intermediate_size), ("vocab_size", m.vocab_size)):
        if total % size:
            raise ValueError(f"tensor_parallel_size={size}: the model's {what} ({total}) is not divisible by it")
