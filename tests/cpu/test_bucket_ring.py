"""`torpor.rl.BucketRing`: the buffers a push flattens its buckets into, reused in turn."""

import torch

from torpor.rl.bucket_ring import BucketRing
from torpor.rl.weight_sync import bucket_named_tensors


def test_buffers_are_reused_in_turn_and_grow_once():
    ring = BucketRing(slots=2, bucket_bytes=100)
    cpu = torch.device("cpu")
    first, second, third = ring.take(cpu, 40), ring.take(cpu, 60), ring.take(cpu, 30)
    assert first.untyped_storage().data_ptr() == third.untyped_storage().data_ptr()  # slot 0 again
    assert first.untyped_storage().nbytes() == 40 and first.is_shared()  # its first bucket's size, shared once
    grown = ring.take(cpu, 80)  # slot 1 held 60: it grows to a whole bucket
    assert grown.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert grown.untyped_storage().nbytes() == 100 and ring.take(cpu, 90).numel() == 90
    assert ring.take(cpu, 250).untyped_storage().nbytes() == 250  # an oversized tensor's bucket
    ring.close()
    assert ring.nbytes == 0


def test_buckets_through_a_ring_hold_the_same_bytes_as_buckets_of_their_own():
    generator = torch.Generator().manual_seed(0)
    named = [(f"t{i}", torch.randn(n, generator=generator).to(dtype))
             for i, (n, dtype) in enumerate([(7, torch.float32), (33, torch.bfloat16), (5, torch.float16),
                                             (64, torch.float32), (3, torch.bfloat16)])]
    ring = BucketRing(slots=2, bucket_bytes=128)
    own = list(bucket_named_tensors(named, 128))
    for mine, reused in zip(own, bucket_named_tensors(named, 128, ring), strict=True):
        assert mine.metadata == reused.metadata and torch.equal(mine.flattened, reused.flattened)
