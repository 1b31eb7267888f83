"""`AsyncEngine`'s calls of vLLM's native weight transfer (engine/weights/transfer.py), on its engine thread: the four
phases over HTTP (server/vllm_api.py). A part of `AsyncEngine` kept in a module of its own (the class would pass
700 lines); it uses only `AsyncEngine`'s `_engine`, `config`, `_call` and `_control`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torpor.engine.config import EngineConfig
    from torpor.engine.llm_engine import LLMEngine

logger = logging.getLogger("torpor.server")
RECEIVE_POLL_S = 0.005  # how often a receive from a trainer's group is asked whether it finished


def log_failure(name: str, what: str, exc: BaseException) -> None:
    logger.warning("%s %s failed: %s: %s", name, what, type(exc).__name__, exc)


class TransferCalls:
    """vLLM's four phases: init, start, chunks, finish; the server's idle timeout abandons an update."""

    if TYPE_CHECKING:  # AsyncEngine's
        _engine: LLMEngine
        config: EngineConfig

        async def _call(self, fn: Callable[..., Any], *args: Any) -> Any: ...
        async def _control(self, name: str, what: str, fn: Callable[..., Any], *args: Any) -> Any: ...

    async def init_weight_transfer_engine(self, init_info: dict) -> None:
        """The nccl backend's rendezvous waits for the trainer: at TP=1 off the engine thread (requests go on)."""
        if self.config.tensor_parallel_size == 1:
            start = time.perf_counter()
            try:
                await asyncio.to_thread(self._engine.init_weight_transfer_engine, init_info)
            except Exception as exc:
                log_failure("init_weight_transfer_engine", "", exc)
                raise
            logger.info("init_weight_transfer_engine: %.3f s", time.perf_counter() - start)
            return
        await self._control("init_weight_transfer_engine", "", self._engine.init_weight_transfer_engine, init_info)

    async def start_weight_update(self, include_draft: bool, is_checkpoint_format: bool) -> str:
        """The id of the update begun (the server gives it up after push_idle_timeout_s without a call)."""
        transfer = self._engine.transfer

        def start() -> str:
            transfer.start(include_draft, is_checkpoint_format)
            return transfer.update_id

        return await self._control("start_weight_update", "", start)

    async def update_weights_transfer(self, update_info: dict) -> int:
        """One chunk. ipc: opened, checked and copied on the engine thread. nccl: every rank receives on a thread of
        its own while the trainer broadcasts (the engine thread stays free; nothing is served meanwhile: the update
        is in progress), then the copy runs on the engine thread."""
        transfer, start = self._engine.transfer, time.perf_counter()
        try:
            chunk = await self._call(transfer.chunk, update_info)
            what = f"{len(chunk.names)} tensors ({transfer.backend})"
            if transfer.backend == "ipc":
                count = await self._call(transfer.apply_ipc, chunk)
            else:
                await self._call(transfer.start_nccl, chunk)
                deadline = time.monotonic() + transfer.timeout_s + 1.0  # the receive ends by its own deadline first
                while not await self._call(transfer.nccl_done):
                    if time.monotonic() > deadline:
                        await self._call(transfer.give_up_nccl)
                    await asyncio.sleep(RECEIVE_POLL_S)
                count = await self._call(transfer.finish_nccl, chunk, True)
        except Exception as exc:
            log_failure("update_weights", "(a chunk of the four-phase update)", exc)
            raise
        logger.info("update_weights %s: %.3f s", what, time.perf_counter() - start)
        return count

    async def finish_weight_update(self, weight_version: str | None) -> None:
        return await self._control("finish_weight_update", repr(weight_version), self._engine.finish_weight_update,
                                   weight_version)

    def abandon_transfer(self, update_id: str, reason: str) -> None:
        """Engine thread: the server's idle timeout ends the four-phase update `update_id` if it still runs."""
        if self._engine.transfer.abandon(update_id, reason):
            logger.warning("weight update %s abandoned: %s", update_id, reason)

    def transfer_in_progress(self, update_id: str) -> bool:
        """Any thread (a read): whether `update_id` is still the update in progress."""
        return self._engine.weights.in_progress(update_id)
