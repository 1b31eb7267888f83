"""Host (CPU) backend: the same contract as CUDA, on host memory.

Tensors created in a tag scope land in the tag's arena (anonymous mmap chunks, see host_arena)
through a `TorchDispatchMode` that is active while the thread is in a tag scope: every aten op
whose CPU output is fresh memory (not a view of an input, not already in the arena) gets its
output moved into the arena; `empty`/`zeros`-like factories are built in the arena directly,
so a large KV cache is never allocated twice. Views and in-place ops keep their storage, so
tensors created in a scope can be written anywhere later.

Sleep: `discard` is `madvise(MADV_DONTNEED)` (the pages go back to the kernel, RSS drops, the
addresses stay and read back as zeros); `offload` first writes the chunk's live bytes to a backup
file in `backup_dir` (opened and unlinked at once, so nothing is left behind; the page cache is
not process RSS), and wake reads them back into the same addresses.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Collection

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from torpor.memory.host_arena import HostArena, HostChunk
from torpor.memory.segments import Segment, SegmentStore
from torpor.memory.system import process_rss_bytes
from torpor.memory.types import Action, HostMemoryError, TagReport

aten = torch.ops.aten
_EMPTY_OPS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
              aten.new_empty.default, aten.new_empty_strided.default}
_ZEROS_OPS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_LIKE_OPS = {aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default,
             aten.zeros_like.default, aten.new_zeros.default}


def _storage_nbytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (t.storage_offset() + span + 1) * t.element_size()


class HostBackend(SegmentStore):
    """Per-tag host arenas with sleep (madvise / backup files) and wake."""

    def __init__(self, max_host_bytes: int | None = None, backup_dir: str | None = None,
                 chunk_bytes: int = 16 << 20, on_new_segment=None) -> None:
        super().__init__(max_host_bytes)
        self.backup_dir = backup_dir or tempfile.gettempdir()
        self.arena = HostArena(self, chunk_bytes)
        self.on_new_segment = on_new_segment or (lambda tag, size: None)
        self._local = threading.local()  # per thread: tag stack and the active mode

    # ---- tags and scopes ---------------------------------------------------------------
    def create_tag(self, tag: str) -> None:
        pass  # a tag's chunks are made on its first allocation

    def close(self) -> None:
        """Nothing to drop: chunks are unmapped when their last tensor dies."""

    def current_tag(self) -> str | None:
        stack = getattr(self._local, "tags", None)
        return stack[-1] if stack else None

    def enter_scope(self, tag: str, parent: str | None) -> None:
        # One mode per thread for the outermost scope; nested scopes only change the tag it
        # reads, so the innermost tag wins and foreign modes entered in between stay balanced.
        if parent is None:
            self._local.tags = [tag]
            self._local.mode = _ArenaMode(self)
            self._local.mode.__enter__()
        else:
            self._local.tags.append(tag)

    def exit_scope(self, tag: str, parent: str | None) -> None:
        self._local.tags.pop()
        if parent is None:
            self._local.mode.__exit__(None, None, None)
            self._local.mode = None

    def place(self, tag: str, like: torch.Tensor, copy_from: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor with `like`'s dtype, shape and strides in `tag`'s arena, holding `copy_from`'s
        storage bytes when given."""
        nbytes = _storage_nbytes(like)
        block = self.arena.allocate(tag, nbytes)
        storage = torch.frombuffer(block, dtype=torch.uint8).untyped_storage()
        out = torch.empty(0, dtype=like.dtype).set_(storage, like.storage_offset(), like.shape, like.stride())
        if copy_from is not None and nbytes:
            src = torch.empty(0, dtype=torch.uint8).set_(copy_from.untyped_storage())
            dst = torch.empty(0, dtype=torch.uint8).set_(storage)
            dst[:nbytes].copy_(src[:nbytes])
        return out

    # ---- sleep / wake ------------------------------------------------------------------
    def sleep(self, plan: dict[str, Action], clean: Collection[str] = ()) -> list[TagReport]:
        self.arena.drain()
        return super().sleep(plan, clean)

    def check_sleep(self, plan: dict[str, Action], clean: Collection[str] = ()) -> None:
        self.arena.drain()
        super().check_sleep(plan, clean)

    def _reserve_backups(self, segments: list[Segment]) -> None:
        made: list[Segment] = []
        try:
            for seg in segments:
                seg.used = seg.high_water
                if seg.backup is None:
                    fd, path = tempfile.mkstemp(prefix="torpor-backup-", dir=self.backup_dir)
                    os.unlink(path)
                    seg.backup = fd
                    made.append(seg)
                os.posix_fallocate(seg.backup, 0, seg.used)
        except OSError as exc:
            for seg in made:
                os.close(seg.backup)
                seg.backup = None
            need = sum(s.used for s in segments) / 2**20
            raise HostMemoryError(f"no room for a {need:.1f} MiB offload in {self.backup_dir} ({exc}); "
                                  "nothing was released") from None

    def _backup_need(self, segment: HostChunk) -> int:
        return segment.high_water  # only the live bytes are written

    def backup_size(self, segment: Segment) -> int:
        return os.fstat(segment.backup).st_size

    def _free_backup(self, segment: Segment) -> None:
        os.close(segment.backup)

    def _synchronize(self) -> None:
        pass  # CPU ops have finished when they return

    def _copy_out(self, segments: list[Segment]) -> None:
        try:
            for seg in segments:
                with memoryview(seg.mapping) as whole, whole[: seg.used] as part:
                    done = 0
                    while done < seg.used:
                        done += os.pwrite(seg.backup, part[done:], done)
        except OSError as exc:
            raise HostMemoryError(f"writing an offload to {self.backup_dir} failed ({exc}); "
                                  "nothing was released") from None

    def _release(self, segment: HostChunk) -> None:
        segment.mapping.madvise(mmap.MADV_DONTNEED, 0, segment.size)

    def _restore(self, segment: HostChunk) -> None:
        # The address range stayed mapped, so a write into a sleeping tag lands in fresh pages; drop them
        # first: discarded memory comes back zero-filled and offloaded memory exactly as it was copied.
        segment.mapping.madvise(mmap.MADV_DONTNEED, 0, segment.size)
        if not segment.holds_copy:
            return  # MADV_DONTNEED pages of a private anonymous mapping read back as zeros
        with memoryview(segment.mapping) as whole, whole[: segment.used] as part:
            done = 0
            while done < segment.used:
                got = os.preadv(segment.backup, [part[done:]], done)
                if got == 0:
                    raise HostMemoryError(f"backup file of tag {segment.tag!r} is truncated")
                done += got

    def _finish_fills(self) -> None:
        pass

    def _finish_copies(self, segments: list[Segment]) -> None:
        pass  # pwrite has returned

    def _copy_in(self, segments: list[Segment]) -> None:
        for seg in segments:
            with memoryview(seg.mapping) as whole, whole[: seg.used] as part:
                done = 0
                while done < seg.used:
                    got = os.preadv(seg.backup, [part[done:]], done)
                    if got == 0:
                        raise HostMemoryError(f"backup file of tag {seg.tag!r} is truncated")
                    done += got

    def _read_device(self, segment: HostChunk, offset: int, size: int) -> bytes:
        return segment.mapping[offset: offset + size]

    def _read_copy(self, segment: HostChunk, offset: int, size: int) -> bytes:
        return os.pread(segment.backup, size, offset)

    # ---- readings ----------------------------------------------------------------------
    def allocated_bytes(self) -> tuple[dict[str, int], int]:
        """Bytes in live blocks per tag; untagged bytes are not visible on the host (0)."""
        self.arena.drain()
        per_tag: dict[str, int] = {}
        with self.lock:
            for seg in self.segments.values():
                per_tag[seg.tag] = per_tag.get(seg.tag, 0) + seg.allocated
        return per_tag, 0

    def device_used_bytes(self) -> int:
        """Resident set size of this process."""
        return process_rss_bytes()


class _ArenaMode(TorchDispatchMode):
    """Moves fresh CPU outputs of aten ops into the current tag's arena."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: `__torch_dispatch__` stays as written. By default TorchDispatchMode wraps it in
        torch._disable_dynamo, whose first call imports torch._dynamo (and sympy, torch._inductor): 1.3-2.5 s
        of a CPU engine's start-up. Nothing here runs under torch.compile, so the wrapper has nothing to do."""
        return False

    def __init__(self, backend: HostBackend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tag = self.backend.current_tag()
        if (func in _EMPTY_OPS or func in _ZEROS_OPS) and self._targets_cpu(func, args, kwargs):
            meta = func(*args, **{**kwargs, "device": "meta"})
            out = self.backend.place(tag, meta)
            return out.zero_() if func in _ZEROS_OPS else out
        out = func(*args, **kwargs)
        if func is aten.lift_fresh.default:  # torch.tensor(data): the input *is* fresh memory
            inputs: set[int] = set()
        else:
            leaves, _ = tree_flatten((args, kwargs))
            inputs = {t.untyped_storage().data_ptr() for t in leaves
                      if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"}
        return tree_map_only(torch.Tensor, lambda t: self._place(t, tag, inputs), out)

    def _place(self, t: torch.Tensor, tag: str, inputs: set[int]) -> torch.Tensor:
        if (t.device.type != "cpu" or t.layout != torch.strided or t.numel() == 0 or type(t) is not torch.Tensor
                or t.is_quantized):  # a quantized tensor's quantizer cannot be carried over by `set_`
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in inputs or self.backend.find(ptr) is not None:
            return t  # a view or in-place result, or already in an arena chunk
        return self.backend.place(tag, t, copy_from=t)

    @staticmethod
    def _targets_cpu(func, args, kwargs) -> bool:
        if kwargs.get("pin_memory"):
            return False
        device = kwargs.get("device")
        if device is None:
            device = args[0].device if func in _LIKE_OPS else torch.get_default_device()
        return torch.device(device).type == "cpu"
