"""Segment bookkeeping and the sleep/wake algorithm shared by the CUDA and host backends.

A *segment* is one address range the backend handed out (a CUDA caching-allocator segment, or
one mmap chunk of a host arena). Sleep and wake work segment by segment; addresses never change.
A backend subclasses `SegmentStore` and supplies the device primitives (`_reserve_backups`,
`_copy_out`, `_release`, `_restore`, ...). The algorithm here owns the guarantees:

- sleep gets every host copy it needs *before* it releases anything, so a failure leaves the
  whole plan awake; it synchronizes the device before copying and unmapping;
- wake maps segment by segment and, if the device has no memory left, releases what it mapped,
  keeps every host copy and raises `WakeError`, so the call can be retried.

Locking: `self.lock` guards the segment table. Allocation callbacks run under the framework's
allocator lock and take `self.lock`; sleep and wake hold `self.lock` only around driver calls,
never around a call into the framework's allocator, so the lock order is always
allocator lock -> self.lock and cannot deadlock.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass

from torpor.env import Env
from torpor.memory.types import Action, HostMemoryError, StaleCopyError, TagReport, WakeError

VERIFY_CHUNK_BYTES = 64 << 20


@dataclass(eq=False)
class Segment:
    address: int
    size: int  # bytes mapped for it (a multiple of the backend's granularity)
    tag: str
    resident: bool = True  # backed by device memory now
    holds_copy: bool = False  # `backup` has this segment's bytes (asleep after an offload)
    backup: object | None = None  # backend host buffer, kept and reused across cycles
    used: int = 0  # bytes worth copying, from the start (host arenas); 0 = the whole segment
    # `backup` still equals the device bytes: set by a wake from the copy, cleared by any declared write
    # (`MemoryManager.mark_dirty`, a tag scope) and by a discard. Trusted only for tags marked clean.
    copy_current: bool = False

    @property
    def copy_bytes(self) -> int:
        return self.used or self.size


def _size(nbytes: int) -> str:
    """Bytes for a message: MiB from 1 MiB on, else exact bytes (a rounded "0 MiB" names nothing)."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


class DeviceOutOfMemory(Exception):
    """Raised by `_restore` when the device has no memory for a segment."""


class SegmentStore(ABC):
    """Per-tag segment tables and the generic, all-or-nothing sleep/wake algorithm."""

    def __init__(self, max_host_bytes: int | None = None) -> None:
        self.lock = threading.RLock()
        self.segments: dict[int, Segment] = {}
        self.max_host_bytes = max_host_bytes
        self.asleep: set[str] = set()  # tags whose segments are released; their pools must not grow

    # ---- bookkeeping -------------------------------------------------------------------
    def add(self, segment: Segment) -> None:
        with self.lock:
            self.segments[segment.address] = segment

    def pop(self, address: int) -> Segment | None:
        with self.lock:
            return self.segments.pop(address, None)

    def of_tag(self, tag: str) -> list[Segment]:
        with self.lock:
            return [s for s in self.segments.values() if s.tag == tag]

    def host_backup_bytes(self) -> int:
        with self.lock:
            return sum(self.backup_size(s) for s in self.segments.values() if s.backup is not None)

    def find(self, address: int) -> Segment | None:
        """The segment that contains `address`, if any."""
        with self.lock:
            for seg in self.segments.values():
                if seg.address <= address < seg.address + seg.size:
                    return seg
        return None

    # ---- the algorithm -----------------------------------------------------------------
    def sleep(self, plan: dict[str, Action], clean: Collection[str] = ()) -> list[TagReport]:
        """Release every segment of the tags in `plan` (offload or discard). All or nothing. Offloaded
        segments of the tags in `clean` whose host copy is still current are not copied again."""
        verify = Env.read().verify_clean_copies  # a bad value raises before anything is touched
        with self.lock:
            by_tag = {tag: [s for s in self.of_tag(tag) if s.resident] for tag in plan}
            kept, fresh = self._offloads(plan, clean)
            self._check_host_budget(fresh)
            reserved = all(s.backup is not None for s in fresh)
            if reserved:
                self._reserve_backups(fresh)  # (sizes the host backend's files) raises HostMemoryError
            self._synchronize()
            if kept and verify:
                self._verify_copies(kept)  # raises StaleCopyError; nothing released yet
            dropped = {tag: segs for tag, segs in by_tag.items() if plan[tag] is Action.DISCARD}
            if reserved:
                # What is only dropped goes back to the driver before the copies out start: the driver clears freed
                # device memory behind the caller's back, and that clearing slows the next copies in (a weights
                # wake right after a sleep that released a 108 GiB KV cache: 0.2 s slower) unless it overlaps this
                # sleep's own copies out (docs/benchmarks.md, the KV curve).
                released = {tag: self._release_tag(tag, segs, plan[tag], fresh) for tag, segs in dropped.items()}
                try:
                    self._copy_out(fresh)
                except BaseException:
                    self.wake(dict.fromkeys(dropped, Action.DISCARD))  # no tag left unmapped: back, zeroed
                    raise
            else:
                # Host copies still to make (a sleep before the reservation ended): each buffer is made while the
                # copy into the one before runs, then everything is released.
                self._reserve_and_copy_out(fresh)  # raises HostMemoryError; nothing released yet
                released = {tag: self._release_tag(tag, segs, plan[tag], fresh) for tag, segs in dropped.items()}
            released.update({tag: self._release_tag(tag, segs, plan[tag], fresh) for tag, segs in by_tag.items()
                             if plan[tag] is not Action.DISCARD})
            reports = [released[tag] for tag in by_tag]
            # A discarding sleep also gives back old host copies, last: freeing pinned memory holds the
            # driver (1.5 s for 16 GB measured), so the device memory goes back first.
            for tag in (t for t, a in plan.items() if a is Action.DISCARD):
                self.drop_copies(tag)
            self.asleep.update(plan)
            return reports

    def _reserve_and_copy_out(self, segments: list[Segment]) -> None:
        """Make each segment's host buffer where it has none and queue its copy at once, so that making the next
        buffer (pinning: ~0.05 s per GiB on many threads) overlaps the copies before it. On a failure the queued
        copies are waited for and the buffers made here are given back; HostMemoryError, nothing released."""
        queued: list[Segment] = []
        made: list[Segment] = []
        try:
            for seg in segments:
                new = seg.backup is None
                self._reserve_backups([seg])
                if new:
                    made.append(seg)
                self._copy_out([seg])
                queued.append(seg)
        except BaseException:
            self._synchronize()  # every copy queued, a failed segment's first chunks too, before a buffer goes
            self._finish_copies(queued)
            for seg in made:
                self._free_backup(seg)
                seg.backup = None
            raise

    def _release_tag(self, tag: str, segs: list[Segment], action: Action, fresh: list[Segment]) -> TagReport:
        """Release `segs` (the tag's resident segments; an offload's copies queued already) and report it."""
        for seg in segs:
            self._release(seg)
            seg.resident = False
            seg.holds_copy = action is Action.OFFLOAD
            seg.copy_current = seg.holds_copy
        copied = sum(s.copy_bytes for s in segs if s in fresh) if action is Action.OFFLOAD else 0
        return TagReport(tag, action, bytes_copied=copied, bytes_released=sum(s.size for s in segs))

    def check_sleep(self, plan: dict[str, Action], clean: Collection[str] = ()) -> None:
        """Raise HostMemoryError, touching nothing, if `sleep(plan, clean)` would exceed `max_host_bytes`."""
        with self.lock:
            self._check_host_budget(self._offloads(plan, clean)[1])

    def _offloads(self, plan: dict[str, Action], clean: Collection[str]) -> tuple[list[Segment], list[Segment]]:
        """The resident segments an offload in `plan` releases: (whose current host copy is kept, to copy)."""
        offload = [s for tag, action in plan.items() if action is Action.OFFLOAD for s in self.of_tag(tag)
                   if s.resident]
        kept = [s for s in offload if s.copy_current and s.tag in clean]
        return kept, [s for s in offload if not (s.copy_current and s.tag in clean)]

    def wake(self, plan: dict[str, Action]) -> list[TagReport]:
        """Map the segments of the tags in `plan` again and restore (offload) or zero (discard)
        their contents. On device OOM: roll back, keep host copies, raise WakeError."""
        with self.lock:
            segs = [s for tag in plan for s in self.of_tag(tag) if not s.resident]
            mapped: list[Segment] = []
            try:
                for seg in segs:  # map one, then queue its copy: copies overlap later maps
                    self._restore(seg)
                    mapped.append(seg)
                self._finish_fills()
            except DeviceOutOfMemory as exc:
                self._finish_fills()
                for seg in mapped:
                    self._release(seg)
                need = sum(s.size for s in segs)
                raise WakeError(
                    f"wake of {sorted(plan)} needs {need / 2**20:.0f} MiB of device memory but the device "
                    f"ran out after {len(mapped)} of {len(segs)} segments ({exc}); nothing was lost: "
                    "host copies are kept and the call can be retried once memory is free") from None
            reports = [self._wake_report(tag, plan[tag], [s for s in segs if s.tag == tag]) for tag in plan]
            for seg in segs:
                seg.resident = True
                seg.copy_current = seg.holds_copy  # refilled from the copy: they are equal again
                seg.holds_copy = False
            self.asleep.difference_update(plan)
            return reports

    def reserve(self, tags: list[str], max_segments: int | None = None) -> int | None:
        """Make now the host buffers an offload of `tags` will need; returns the bytes they hold. With
        `max_segments`, at most that many (None when no segment is left without one)."""
        with self.lock:
            segs = [s for tag in tags for s in self.of_tag(tag) if s.resident and s.backup is None]
            if max_segments is not None:
                if not segs:
                    return None
                segs = segs[:max_segments]
            self._check_host_budget(segs)
            self._reserve_backups(segs)  # raises HostMemoryError having freed what it made
            return sum(self.backup_size(s) for s in segs)

    def reserve_one(self, tags: list[str]) -> int | None:
        """`reserve(tags, max_segments=1)`: the host copy of one more segment; None when none is left. A
        backend whose buffers take long to make (pinning) overrides it to make the buffer outside the lock."""
        return self.reserve(tags, max_segments=1)

    def _next_unreserved(self, tags: list[str]) -> Segment | None:
        """The first resident segment of `tags` without a host buffer (call with the lock held)."""
        return next((s for tag in tags for s in self.of_tag(tag) if s.resident and s.backup is None), None)

    def mark_dirty(self, tag: str) -> None:
        """The tag's device bytes may differ from its host copy from now on."""
        with self.lock:
            for seg in self.of_tag(tag):
                seg.copy_current = False

    def copy_is_current(self, tag: str) -> bool:
        """Whether every resident segment of `tag` has a host copy equal to it (as far as declared)."""
        with self.lock:
            segs = [s for s in self.of_tag(tag) if s.resident]
            return bool(segs) and all(s.copy_current and s.backup is not None for s in segs)

    def snapshot(self, tag: str) -> int:
        """Copy the resident segments of `tag` whose copy is not current into their host copies (made first:
        HostMemoryError touching nothing); they stay resident. Returns the bytes copied."""
        with self.lock:
            segs = [s for s in self.of_tag(tag) if s.resident and not (s.copy_current and s.backup is not None)]
            self._check_host_budget(segs)
            self._reserve_backups(segs)
            self._synchronize()
            self._copy_out(segs)
            self._finish_copies(segs)
            for seg in segs:
                seg.copy_current = True
            return sum(s.copy_bytes for s in segs)

    def revert(self, tag: str) -> int:
        """Copy the host copies of `tag`'s resident segments back over them (each must have one: the bytes
        before the writes to undo). Returns the bytes copied."""
        with self.lock:
            segs = [s for s in self.of_tag(tag) if s.resident]
            missing = [s for s in segs if s.backup is None]
            if missing:
                raise ValueError(f"tag {tag!r} has no host copy to revert to ({len(missing)} of {len(segs)} "
                                 "segments): snapshot it before writing")
            self._synchronize()
            self._copy_in(segs)
            for seg in segs:
                seg.copy_current = True
            return sum(s.copy_bytes for s in segs)

    def current_copy_bytes(self, tag: str) -> int:
        """Bytes of the tag's resident segments whose host copy equals them (as far as declared)."""
        with self.lock:
            return sum(s.copy_bytes for s in self.of_tag(tag) if s.resident and s.copy_current)

    def _verify_copies(self, segments: list[Segment]) -> None:
        """Debug check (TORPOR_VERIFY_CLEAN_COPIES=1): each retained host copy hashes like the device bytes."""
        for seg in segments:
            device, copy = hashlib.blake2b(), hashlib.blake2b()
            for offset in range(0, seg.copy_bytes, VERIFY_CHUNK_BYTES):
                n = min(VERIFY_CHUNK_BYTES, seg.copy_bytes - offset)
                device.update(self._read_device(seg, offset, n))
                copy.update(self._read_copy(seg, offset, n))
            if device.digest() != copy.digest():
                raise StaleCopyError(
                    f"tag {seg.tag!r} was written after it was marked clean without mark_dirty: its host copy of "
                    f"the {seg.copy_bytes} bytes at {seg.address:#x} differs from the device bytes; nothing was "
                    "released (call mark_dirty on every write path)")

    def drop_copies(self, tag: str) -> int:
        """Forget the host copy of a sleeping tag (it becomes discarded); returns bytes freed."""
        with self.lock:
            freed = 0
            for seg in self.of_tag(tag):
                if seg.backup is not None:
                    freed += self.backup_size(seg)
                    self._free_backup(seg)
                    seg.backup = None
                seg.holds_copy = False
                seg.copy_current = False
            return freed

    @staticmethod
    def _wake_report(tag: str, action: Action, segs: list[Segment]) -> TagReport:
        mapped = sum(s.size for s in segs)
        copied = sum(s.copy_bytes for s in segs if s.holds_copy)
        zeroed = sum(s.size for s in segs if not s.holds_copy)
        return TagReport(tag, action, bytes_copied=copied, bytes_mapped=mapped, bytes_zeroed=zeroed)

    def _check_host_budget(self, offload: list[Segment]) -> None:
        if self.max_host_bytes is None:
            return
        new = sum(self._backup_growth(s) for s in offload)
        held = self.host_backup_bytes()
        if held + new > self.max_host_bytes:
            raise HostMemoryError(
                f"offload needs {_size(new)} more host memory; {_size(held)} are held and max_host_bytes is "
                f"{_size(self.max_host_bytes)}; nothing was released")

    def _backup_need(self, segment: Segment) -> int:
        """Host bytes a backup of `segment` will take."""
        return segment.size

    def _backup_growth(self, segment: Segment) -> int:
        """Host bytes an offload of `segment` adds to what its backup holds (a host chunk's live bytes
        may have grown since its backup was made)."""
        held = self.backup_size(segment) if segment.backup is not None else 0
        return max(self._backup_need(segment) - held, 0)

    # ---- device primitives -------------------------------------------------------------
    @abstractmethod
    def _reserve_backups(self, segments: list[Segment]) -> None:
        """Give every segment a host buffer of its size, or raise HostMemoryError having
        freed the buffers this call made."""

    @abstractmethod
    def backup_size(self, segment: Segment) -> int:
        """Host bytes held by the segment's backup."""

    @abstractmethod
    def _free_backup(self, segment: Segment) -> None: ...

    @abstractmethod
    def _synchronize(self) -> None:
        """Wait for all work on the device that may touch the segments."""

    @abstractmethod
    def _copy_out(self, segments: list[Segment]) -> None:
        """Start copying each segment into its backup. A failure that can be seen here must
        raise before anything is released; `_release` waits for the segment's own copy."""

    @abstractmethod
    def _release(self, segment: Segment) -> None:
        """Give the segment's physical memory back (after its copy, if any, is done); the
        address range stays reserved."""

    @abstractmethod
    def _restore(self, segment: Segment) -> None:
        """Back the segment's address range with fresh memory and queue its refill: the host
        copy if it holds one, else zeros. If the device is full, undo this segment's own
        mapping and raise DeviceOutOfMemory."""

    @abstractmethod
    def _finish_fills(self) -> None:
        """Wait for the queued restores."""

    @abstractmethod
    def _finish_copies(self, segments: list[Segment]) -> None:
        """Wait for `_copy_out` of `segments` (their device memory stays mapped)."""

    @abstractmethod
    def _copy_in(self, segments: list[Segment]) -> None:
        """Copy each resident segment's host copy over its device memory, and wait for it."""

    @abstractmethod
    def _read_device(self, segment: Segment, offset: int, size: int) -> bytes:
        """`size` bytes of the resident segment from `offset` (debug checks only)."""

    @abstractmethod
    def _read_copy(self, segment: Segment, offset: int, size: int) -> bytes:
        """`size` bytes of the segment's host copy from `offset` (debug checks only)."""
