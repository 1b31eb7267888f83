"""Trainer-side helpers for RL post-training against a torpor engine: push a model's weights into a
running engine (over HTTP or in process) by reference in flattened buckets, or by a process group."""

from torpor.rl.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    DistributedPusher,
    PushReport,
    WeightPusher,
    bucket_named_tensors,
    serialize,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "DistributedPusher", "PushReport", "WeightPusher",
           "bucket_named_tensors", "serialize"]
