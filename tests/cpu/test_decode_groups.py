"""Shared prompt prefixes of a decode batch (inputs.prefix_groups, DecodeBuffers): which rows the GPU decode
kernel computes a prefix for together. The kernel itself: tests/cpu/test_triton_decode_interpret.py, and its
bit-identity grouped vs alone on a GPU: tests/gpu/test_triton_decode.py."""

import itertools

import numpy as np
import torch

from torpor.engine.inputs import MIN_PREFIX_TOKENS, DecodeBuffers, prefix_groups
from torpor.engine.sequence import Sequence


def groups_of(starts: np.ndarray, members: np.ndarray) -> list[list[int]]:
    return [members[a:b].tolist() for a, b in itertools.pairwise(starts) if a < b]


def test_rows_with_the_same_prefix_blocks_are_grouped_in_row_order():
    # rows 0, 2, 3 share blocks [7, 8]; row 1 has [7, 9] (same first block, other second); row 4 has no prefix
    prefix_blocks = np.array([2, 2, 2, 2, 0])
    tables = np.array([[7, 8, 1], [7, 9, 2], [7, 8, 3], [7, 8, 4], [5, 6, 0]])
    starts, members = prefix_groups(prefix_blocks, tables, max_members=8)
    assert groups_of(starts, members) == [[0, 2, 3], [1], [4]]
    assert starts.dtype == members.dtype == np.int32 and len(starts) == 6 and starts[-1] == 5


def test_a_shorter_prefix_over_the_same_blocks_is_another_group():
    # the same first block, but a prefix of one block against one of two: the kernel splits each by its length
    starts, members = prefix_groups(np.array([1, 2, 1]), np.array([[3, 4], [3, 4], [3, 9]]), max_members=8)
    assert groups_of(starts, members) == [[0, 2], [1]]


def test_rows_are_grouped_on_all_their_prefix_blocks_not_only_the_last():
    # the same last prefix block after different earlier ones (no prefix cache makes this; a row must still
    # never read another row's blocks)
    starts, members = prefix_groups(np.array([2, 2, 2]), np.array([[3, 8], [7, 8], [3, 8]]), max_members=8)
    assert groups_of(starts, members) == [[0, 2], [1]]


def test_rows_without_a_prefix_are_never_grouped():
    starts, members = prefix_groups(np.zeros(4, dtype=np.int64), np.zeros((4, 3), dtype=np.int32), 8)
    assert groups_of(starts, members) == [[0], [1], [2], [3]]


def test_large_groups_are_cut_at_max_members():
    n = 11
    starts, members = prefix_groups(np.full(n, 3), np.tile([4, 5, 6], (n, 1)), max_members=4)
    assert groups_of(starts, members) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert (starts[3:] == n).all()  # the unused groups are empty


def test_interleaved_prompts_each_form_their_group():
    rng = np.random.default_rng(0)
    owners = rng.integers(0, 5, size=64)  # five prompts, their samples in any order
    prefixes = {p: rng.integers(0, 1000, size=p + 1) for p in range(5)}
    prefix_blocks = np.array([len(prefixes[o]) for o in owners])
    width = prefix_blocks.max() + 2
    tables = np.array([np.concatenate([prefixes[o], rng.integers(1000, 2000, size=width - len(prefixes[o]))])
                       for o in owners])
    starts, members = prefix_groups(prefix_blocks, tables, max_members=64)
    expected = [np.flatnonzero(owners == o).tolist() for o in dict.fromkeys(owners.tolist())]
    assert groups_of(starts, members) == expected


def make_seq(name: str, prompt_len: int, blocks: list[int], outputs: int = 1) -> Sequence:
    seq = Sequence(name, list(range(prompt_len)))
    seq.token_ids += [1] * outputs
    seq.block_table = blocks
    return seq


def host_header(buffers: DecodeBuffers, batch_size: int) -> tuple[list, list, list]:
    s = buffers.max_num_seqs
    header = buffers.lens_tables  # on CPU the buffers themselves
    return (header[s : s + batch_size].tolist(), header[2 * s : 2 * s + batch_size + 1].tolist(),
            header[3 * s + 1 : 3 * s + 1 + batch_size].tolist())


def test_decode_buffers_give_each_row_its_prompt_prefix_and_group():
    block_size = 16
    buffers = DecodeBuffers(8, 8, 4, torch.float32, torch.device("cpu"), block_size, scratch_block=99,
                            max_group_members=2)
    prompt = 4 * block_size + 5  # four full prompt blocks shared; the partial fifth is each sample's own
    samples = [make_seq("a", prompt, [10, 11, 12, 13, 20 + i]) for i in range(3)]
    short = make_seq("b", MIN_PREFIX_TOKENS - 1, [30, 31, 32, 33])  # under MIN_PREFIX_TOKENS: no prefix
    other = make_seq("c", prompt, [40, 41, 42, 43, 44])
    buffers.load([samples[0], short, samples[1], other, samples[2]], batch_size=8)
    prefix_lens, starts, members = host_header(buffers, 8)
    assert prefix_lens == [64, 0, 64, 64, 64, 0, 0, 0]
    # groups of at most 2: [a0, a1], [a2], [b], [c], then the three padded rows alone, then nothing
    assert [members[a:b] for a, b in itertools.pairwise(starts) if a < b] == [
        [0, 2], [4], [1], [3], [5], [6], [7]]
    assert starts[-1] == 8


def test_decode_buffers_regroup_only_when_the_rows_change():
    buffers = DecodeBuffers(4, 8, 4, torch.float32, torch.device("cpu"), 16, scratch_block=99, max_group_members=8)
    a = [make_seq("a", 64, [1, 2, 3, 4, 10 + i]) for i in range(2)]  # four prefix blocks, their own fifth
    buffers.load(a, batch_size=4)
    groups = buffers._groups
    assert host_header(buffers, 4)[2][:2] == [0, 1] and host_header(buffers, 4)[1][:2] == [0, 2]
    a[0].token_ids.append(5)  # a decode step: same rows, one token longer
    buffers.load(a, batch_size=4)
    assert buffers._groups is groups
    b = make_seq("b", 64, [1, 2, 3, 4, 20])  # a new row with the same prefix blocks joins the group
    buffers.load([*a, b], batch_size=4)
    _prefix_lens, starts, members = host_header(buffers, 4)
    assert buffers._groups is not groups and members[: starts[1]] == [0, 1, 2]


def test_a_new_sequence_on_a_departed_ones_row_is_grouped_anew():
    # the same row ids in the same order, but one row now holds another sequence: its prefix is its own
    buffers = DecodeBuffers(4, 8, 4, torch.float32, torch.device("cpu"), 16, scratch_block=99, max_group_members=8)
    a = [make_seq("a", 64, [1, 2, 3, 4, 10 + i]) for i in range(2)]
    buffers.load(a, batch_size=2)
    assert host_header(buffers, 2)[1][:2] == [0, 2]  # one group of two
    b = make_seq("b", 80, [5, 6, 7, 8, 9, 11])  # takes a[1]'s row: a prompt of five blocks, other blocks
    buffers.load([a[0], b], batch_size=2)
    prefix_lens, starts, members = host_header(buffers, 2)
    assert prefix_lens == [64, 80] and groups_of(np.array(starts), np.array(members)) == [[0], [1]]
