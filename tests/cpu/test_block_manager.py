import pytest

from torpor.engine.block_manager import BlockManager
from torpor.engine.sequence import Sequence


def seq_of(num_tokens: int, request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(range(num_tokens)))


def test_allocate_accounting_and_deterministic_ids():
    bm = BlockManager(num_blocks=8, block_size=16)
    a, b = seq_of(33, "a"), seq_of(16, "b")
    assert bm.num_blocks_for(33) == 3 and bm.num_blocks_for(16) == 1 and bm.num_blocks_for(1) == 1
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3]
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 4


def test_cannot_allocate_beyond_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    big = seq_of(9)
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="needs 3 KV blocks"):
        bm.allocate(big)
    assert bm.num_free_blocks == 2 and big.block_table == []
    small = seq_of(8)
    assert bm.can_allocate(small)
    bm.allocate(small)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(small)


def test_may_append_adds_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = seq_of(4)
    bm.allocate(s)
    assert len(s.block_table) == 1
    bm.may_append(s)                     # 4 tokens fit in one block: nothing to add
    assert len(s.block_table) == 1
    s.append_token(99)                   # 5th token crosses into block 2
    assert bm.can_append(s)
    bm.may_append(s)
    assert s.block_table == [0, 1] and bm.num_free_blocks == 1
    for _ in range(3):
        s.append_token(99)
        bm.may_append(s)
    assert len(s) == 8 and len(s.block_table) == 2


def test_can_append_false_when_no_block_is_free():
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = seq_of(2, "a"), seq_of(2, "b")
    bm.allocate(a)
    bm.allocate(b)
    a.append_token(1)
    assert not bm.can_append(a)
    with pytest.raises(RuntimeError, match="more KV blocks"):
        bm.may_append(a)
    bm.deallocate(b)
    assert bm.can_append(a)
    bm.may_append(a)
    assert a.block_table == [0, 1]


def test_deallocate_returns_blocks_and_clears_cache_state():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq_of(10)
    bm.allocate(s)
    s.num_cached_tokens = 10
    bm.deallocate(s)
    assert bm.num_free_blocks == 4 and s.block_table == [] and s.num_cached_tokens == 0


def test_freeing_blocks_one_does_not_hold_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq_of(4, "a"), seq_of(4, "b")
    bm.allocate(a)
    bm.allocate(b)
    impostor = seq_of(4, "c")
    impostor.block_table = [a.block_table[0]]
    with pytest.raises(RuntimeError, match="does not hold"):
        bm.deallocate(impostor)
    stale = list(b.block_table)
    bm.deallocate(b)
    b.block_table = stale                # double free through a stale table
    with pytest.raises(RuntimeError, match="does not hold"):
        bm.deallocate(b)
    assert bm.num_free_blocks == 3 and a.block_table == [0]


def test_reset_restores_the_cold_state():
    bm = BlockManager(num_blocks=5, block_size=4)
    a, b = seq_of(8, "a"), seq_of(4, "b")
    bm.allocate(a)
    bm.allocate(b)
    bm.deallocate(a)                     # free list is now out of id order
    bm.reset()
    assert bm.num_free_blocks == 5
    c = seq_of(20, "c")
    bm.allocate(c)
    assert c.block_table == [0, 1, 2, 3, 4]


def test_invalid_construction():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
