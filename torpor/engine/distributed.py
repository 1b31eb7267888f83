"""Tensor parallelism: `TPGroup`, one engine's group of ranks as one rank sees it, and the few collectives the
layers use.

Each engine owns its group: a process group built directly on the engine's own rendezvous store (never the
process's default group), so two engines in one process never share collectives. The layers do not hold the
group: they call `tp_rank()`, `tp_size()`, `all_reduce()`, ... which act on the group *active* in the current
context — a Worker activates its engine's group around everything it runs (`with group.active():`), and with
none active the process is rank 0 of 1 and every collective is the identity (a single-device engine never
touches torch.distributed).

On CPU the group is gloo. On GPU it is NCCL by default (its communicator's ~1 GiB per GPU stays while the engine
sleeps); with `EngineConfig.tp_comm = "torpor"` the collectives go through a `TensorExchange` (a symmetric buffer
every rank maps and that sleeps with the engine, see tensor_exchange.py) and the process group is gloo, for
control only.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import secrets
import threading
import warnings
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("torpor.engine")


class TPGroup:
    """Rank `rank` of `size` on `device`; `pg` is None for a group of one."""

    def __init__(self, rank: int = 0, size: int = 1, device: torch.device | None = None, pg=None,
                 exchange=None) -> None:
        self.rank, self.size, self.device, self.pg, self.exchange = rank, size, device, pg, exchange
        self.backend = "none" if pg is None else pg.name()

    @classmethod
    def join(cls, rank: int, size: int, store: dist.Store, device: torch.device, comm: str = "nccl",
             timeout_s: float = 120.0) -> TPGroup:
        """Rank `rank` of the group of `size` ranks that meet at `store` (see `rendezvous_store`).

        On CUDA the rank's device becomes this thread's current device first (nothing ever makes a context on
        another device), and NCCL's communicator (or the exchange buffer) is made now, before any memory tag
        scope and before any CUDA graph capture."""
        if device.type == "cuda" and device.index is None:
            raise ValueError(f"tensor parallelism needs an indexed CUDA device (cuda:N), got {device}")
        nccl = device.type == "cuda" and comm == "nccl"
        timeout = timedelta(seconds=timeout_s)
        store = dist.PrefixStore("torpor-tp/", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if nccl:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        group = cls(rank, size, device, pg)
        if nccl:
            group.all_reduce(torch.zeros(1, device=device))  # forms the communicator now (NCCL is lazy)
        elif device.type == "cuda":
            # The exchange buffer's modules import cuda-bindings and triton: only tp_comm="torpor" engines load them.
            from torpor.engine.symmetric_memory import SymmetricMemory
            from torpor.engine.tensor_exchange import TensorExchange

            if rank == 0:
                store.set("group_key", f"{secrets.token_hex(8)}")
            key = store.get("group_key").decode()
            group.exchange = TensorExchange(SymmetricMemory(rank, size, device, key, group.all_ok,
                                                            timeout_s=min(60.0, timeout_s)))
        return group

    @contextlib.contextmanager
    def active(self) -> Iterator[TPGroup]:
        """The layers' collectives act on this group inside the block (this context only)."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    # ---- collectives -----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op=None) -> torch.Tensor:
        """Sum (or `op`) of `x` over the ranks, in place (the partial outputs of row-parallel layers)."""
        if self.size == 1:
            return x
        if self.exchange is not None and op is None:
            return self.exchange.all_reduce(x)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM if op is None else op
        self.pg.allreduce([x], options).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., n * size], rank order (vocab-sharded logits)."""
        if self.size == 1:
            return x
        if self.exchange is not None:
            return self.exchange.gather_last_dim(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """`x` of rank 0 into `x` of every rank (same shape and dtype everywhere), in place."""
        if self.size == 1:
            return x
        if self.exchange is not None:
            return self.exchange.broadcast(x)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([x], options).wait()
        return x

    def min(self, value: int) -> int:
        """The smallest `value` of all ranks (e.g. the KV blocks that fit on every device)."""
        if self.size == 1:
            return value
        on_device = self.backend == "nccl"  # gloo reduces host tensors
        t = torch.tensor([value], dtype=torch.int64, device=self.device if on_device else "cpu")
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def all_ok(self, ok: bool) -> bool:
        """True if every rank passed ok=True: a barrier that also tells each rank whether the others succeeded
        (over gloo under `tp_comm="torpor"`, on the host)."""
        if self.size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                            device=self.device if self.backend == "nccl" else "cpu")
        return bool(self.all_reduce(flag, dist.ReduceOp.MIN).item())

    # ---- the exchange buffer sleeps with the engine ---------------------------------------------------
    def release_exchange(self) -> None:
        """Give the exchange buffer's device memory back (every rank, when the engine sleeps; the device idle)."""
        if self.exchange is not None:
            self.exchange.buffer.unmap()

    def restore_exchange(self) -> None:
        """Map the exchange buffer again at the same addresses (every rank at once, when the engine wakes)."""
        if self.exchange is not None:
            self.exchange.buffer.map()

    def check_exchange(self) -> None:
        """Raise if a collective of the exchange gave up waiting for a peer (call after a step)."""
        if self.exchange is not None and self.exchange.buffer.is_mapped:
            self.exchange.check()

    # ---- leaving ---------------------------------------------------------------------------------
    def abort(self) -> bool:
        """Abort this rank's NCCL communicator (from any thread): collectives pending on it, or issued later,
        fail instead of waiting for a peer that is gone. gloo notices a dead peer by itself. Returns whether it
        aborted."""
        if self.backend != "nccl":
            return False
        self.pg.abort()
        return True

    def shutdown(self, healthy: bool = True, timeout_s: float = 60.0) -> bool:
        """Leave the group. Returns False if it could not be torn down within `timeout_s` (it is then left
        behind). healthy: every rank is alive and leaves now too; NCCL's communicator teardown is an intra-node
        collective (a rank leaving alone waits for the others), so the ranks meet in a barrier first (every
        backend, so gloo on CPU checks the same protocol). Not healthy (a rank died or hangs): no barrier;
        NCCL's communicator is aborted instead."""
        pg, exchange, self.pg, self.exchange = self.pg, self.exchange, None, None
        if exchange is not None:  # local: a peer may be gone
            try:
                exchange.buffer.close()
            except Exception as e:  # the process group must still go
                logger.warning("tensor parallel: releasing the exchange buffer failed: %s", e)
        if pg is None:
            return True
        device, nccl = self.device, self.backend == "nccl"

        def leave() -> None:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # the rank's device (a new thread starts on cuda:0)
            if healthy:
                try:
                    flag = torch.zeros(1, device=device if nccl else "cpu")
                    pg.allreduce([flag]).wait()
                    if nccl:
                        torch.cuda.synchronize(device)
                except Exception:  # a peer went away after all: tear down as not healthy
                    pass
                else:
                    if nccl:
                        pg.shutdown()
                    return
            if nccl:
                pg.abort()

        return _bounded(leave, timeout_s)


SINGLE = TPGroup()  # rank 0 of 1: what runs outside every tensor-parallel engine
_current: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("torpor_tp_group", default=SINGLE)


def current() -> TPGroup:
    """The group active in this context (`TPGroup.active`), else the group of one."""
    return _current.get()


def tp_rank() -> int:
    return _current.get().rank


def tp_size() -> int:
    return _current.get().size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _current.get().all_reduce(x)


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    return _current.get().gather_last_dim(x)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    return _current.get().broadcast(x)


def shard_size(total: int, what: str) -> int:
    """`total` split over the active group's ranks; a clear error when it does not divide."""
    size = tp_size()
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({size})")
    return total // size


def rendezvous_store(port: int, size: int, is_rank0: bool, timeout_s: float) -> dist.TCPStore:
    """The ranks' meeting point on this host: rank 0 hosts it (`port` 0 picks a free port, read back from
    `.port`) and returns at once; the workers connect to rank 0's port."""
    return dist.TCPStore("127.0.0.1", port, size, is_rank0, timedelta(seconds=timeout_s), wait_for_workers=False)


def check_divisible(model_config, size: int) -> None:
    """Raise before any process starts when the model cannot be split over `size` ranks."""
    m = model_config
    for what, total in (("num_attention_heads", m.num_attention_heads), ("num_key_value_heads", m.num_key_value_heads),
                        ("intermediate_size", m.intermediate_size), ("vocab_size", m.vocab_size)):
        if total % size:
            raise ValueError(f"tensor_parallel_size={size}: the model's {what} ({total}) is not divisible by it")


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
                      "left behind", stacklevel=3)
        return False
    if error:
        warnings.warn(f"tearing down the tensor-parallel process group failed: {error[0]!r}", stacklevel=3)
        return False
    return True
