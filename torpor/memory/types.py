"""Public value types of torpor.memory: actions, per-tag usage, sleep/wake reports, errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Action(StrEnum):
    """What sleep does with a tag's memory."""

    OFFLOAD = "offload"  # copy to host, release device memory, copy back on wake
    DISCARD = "discard"  # release; wake brings it back zero-filled
    KEEP = "keep"  # stay resident

    @classmethod
    def parse(cls, value: str | Action) -> Action:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(a.value for a in cls)
            raise ValueError(f"unknown sleep action {value!r}; expected one of: {names}") from None


class TagState(StrEnum):
    AWAKE = "awake"
    ASLEEP = "asleep"


class TorporMemoryError(RuntimeError):
    """Base class of torpor.memory's runtime errors."""


class HostMemoryError(TorporMemoryError):
    """A sleep could not get host memory for its copies; every tag is still awake."""


class WakeError(TorporMemoryError):
    """A wake could not get device memory; what it mapped was rolled back, host copies are kept."""


class StaleCopyError(TorporMemoryError):
    """Debug check: a host copy kept as clean differs from the device bytes (a write was not declared)."""


class TagAsleepError(TorporMemoryError):
    """Memory of a sleeping tag was needed (a tag scope was entered while the tag sleeps)."""


@dataclass(frozen=True)
class TagUsage:
    """Memory of one tag. `reserved_bytes` is what the tag's segments span; of it,
    `resident_bytes` is backed by device (or host) memory now, `offloaded_bytes` is held in
    host copies while asleep and `discarded_bytes` was released without a copy."""

    tag: str
    state: TagState
    reserved_bytes: int
    resident_bytes: int
    offloaded_bytes: int
    discarded_bytes: int
    allocated_bytes: int  # bytes in live tensors (caching-allocator blocks in use)
    host_backup_bytes: int  # host memory kept for this tag's copies (reused across cycles)
    num_segments: int
    sealed: bool


@dataclass(frozen=True)
class TagReport:
    """What one sleep or wake did to one tag."""

    tag: str
    action: Action
    bytes_copied: int = 0  # device->host on sleep, host->device on wake
    bytes_released: int = 0  # device memory freed by a sleep
    bytes_mapped: int = 0  # device memory taken by a wake
    bytes_zeroed: int = 0  # discarded memory zero-filled by a wake


@dataclass(frozen=True)
class Report:
    """The result of one `sleep` or `wake`: per-tag reports plus the wall time."""

    kind: str  # "sleep" | "wake"
    tags: tuple[TagReport, ...]
    seconds: float

    @property
    def bytes_copied(self) -> int:
        return sum(t.bytes_copied for t in self.tags)

    @property
    def bytes_released(self) -> int:
        return sum(t.bytes_released for t in self.tags)

    @property
    def bytes_mapped(self) -> int:
        return sum(t.bytes_mapped for t in self.tags)

    @property
    def copy_gbps(self) -> float:
        """Bytes copied over the whole call's time, in GB/s (1e9 bytes)."""
        return self.bytes_copied / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        moved = self.bytes_copied / 2**20
        freed = (self.bytes_released if self.kind == "sleep" else self.bytes_mapped) / 2**20
        verb = "released" if self.kind == "sleep" else "mapped"
        names = ",".join(t.tag for t in self.tags) or "-"
        return (f"{self.kind}[{names}]: copied {moved:.1f} MiB, {verb} {freed:.1f} MiB "
                f"in {self.seconds * 1e3:.1f} ms ({self.copy_gbps:.1f} GB/s)")


@dataclass(frozen=True)
class LateAllocation:
    """Memory that entered a tag after `seal(tag)` declared it complete."""

    tag: str
    nbytes: int
    where: str  # the Python stack of the allocation, innermost frame last


@dataclass(frozen=True)
class AuditReport:
    """Device memory that escaped the tags, and tags that grew after being sealed.

    `untagged_bytes`: memory the framework's allocator holds outside every tag of this manager
    (the default pool); `other_bytes`: device memory in use that no allocator of this process
    accounts for (CUDA context, library handles, other managers, other processes), or None where
    the device cannot report it."""

    device_used_bytes: int | None
    tagged_bytes: int
    untagged_bytes: int
    other_bytes: int | None
    late_allocations: tuple[LateAllocation, ...] = field(default=())

    @property
    def clean(self) -> bool:
        return self.untagged_bytes == 0 and not self.late_allocations
