"""torpor.memory: tagged, address-stable device and host memory that sleeps and wakes.

    from torpor.memory import MemoryManager
    mm = MemoryManager("cuda:0")            # or "cpu"
    with mm.tag("weights"):
        model = build_model()              # every tensor allocated here lives in "weights"
    mm.sleep({"weights": "offload"})       # device memory released, bytes kept on the host
    mm.wake()                              # same addresses, same bytes

Never imports the engine. See docs/memory.md.
"""

from torpor.memory.checkpoint import (
    CheckpointError,
    CheckpointReport,
    CheckpointUnsupportedError,
    ContextCheckpointedError,
)
from torpor.memory.manager import HostReservation, MemoryManager, close_deferred
from torpor.memory.system import create_stream, device_used_bytes, process_rss_bytes
from torpor.memory.types import (
    Action,
    AuditReport,
    HostMemoryError,
    LateAllocation,
    Report,
    StaleCopyError,
    TagAsleepError,
    TagReport,
    TagState,
    TagUsage,
    TorporMemoryError,
    WakeError,
)

__all__ = [
    "Action",
    "AuditReport",
    "CheckpointError",
    "CheckpointReport",
    "CheckpointUnsupportedError",
    "ContextCheckpointedError",
    "HostMemoryError",
    "HostReservation",
    "LateAllocation",
    "MemoryManager",
    "Report",
    "StaleCopyError",
    "TagAsleepError",
    "TagReport",
    "TagState",
    "TagUsage",
    "TorporMemoryError",
    "WakeError",
    "close_deferred",
    "create_stream",
    "device_used_bytes",
    "process_rss_bytes",
]
