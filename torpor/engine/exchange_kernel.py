"""The Triton kernel behind tensor parallelism's collectives on one node (see tensor_exchange.py).

Every rank owns one slot of a symmetric buffer; slot r sits at the same offset in every rank's address
space. A slot holds a flag per program, then two data areas (double buffering by the flag's parity). The
input is cut into tiles of TILE_BYTES; tile t always belongs to program t % NUM_PROGRAMS (a fixed grid,
every program resident: a program never waits for one that has not started). One call, on every rank at
once, with the same `n`; for each of its tiles, program p with epoch e = its flag + 1:

    write the tile of its input into its own slot's data area e % 2
    release: own flag[p] = e (system scope, after a block barrier: every thread's stores are visible)
    acquire: wait until every rank's flag[p] >= e
    read the tile from every rank's data area e % 2 (rank order: the sum is the same on every rank)

Why two areas are enough: the tile region of parity e % 2 was last written by this same program at an epoch
<= e - 2 and read only by the peers' program p, which set its flag to e - 1 (seen by this program before it
writes) after those reads. A wait that lasts MAX_SPINS polls (seconds: a peer died) gives up, sets the error
word and writes garbage: the host checks the error word (`TensorExchange.check`) after each step.
"""

from __future__ import annotations

import triton
import triton.language as tl

SUM, GATHER, BROADCAST = 0, 1, 2
# Bytes per tile, fixed for every dtype (a tile of BLOCK = TILE_BYTES // itemsize elements), so the bytes of a
# tile region and the program that owns them never change between calls, whatever their dtypes.
TILE_BYTES = 8192
MAX_SPINS = 1 << 24
# What the kernel reads of these: Triton compiles only constexpr globals (a plain int global is a NameError when
# compiled for the GPU, though Triton's interpreter, which runs the CPU tests, accepts it).
_SUM, _GATHER, _BROADCAST, _MAX_SPINS = (tl.constexpr(SUM), tl.constexpr(GATHER), tl.constexpr(BROADCAST),
                                         tl.constexpr(MAX_SPINS))


@triton.jit
def exchange_kernel(x_ptr, out_ptr, data_ptr, flag_ptr, n, out_row_stride, rank,
                    slot_elems, slot_flags, data_offset, area_elems, error_index,
                    SIZE: tl.constexpr, OP: tl.constexpr, BLOCK: tl.constexpr):
    # x_ptr: [n] this rank's input. out_ptr: [n] (SUM, BROADCAST) or [SIZE, out_row_stride] (GATHER).
    # data_ptr / flag_ptr: the symmetric buffer's base, typed as the data / as int64 flags.
    pid = tl.program_id(0)
    own_flag = flag_ptr + rank * slot_flags + pid
    epoch = tl.load(own_flag, volatile=True)
    for tile in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        epoch += 1
        offsets = tile * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        area = data_offset + (epoch % 2) * area_elems
        if OP != _BROADCAST:
            tl.store(data_ptr + rank * slot_elems + area + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
        elif rank == 0:  # a broadcast: only rank 0 has something to say
            tl.store(data_ptr + area + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
        tl.debug_barrier()
        tl.atomic_xchg(own_flag, epoch, sem="release", scope="sys")
        for r in tl.static_range(SIZE):
            peer_flag = flag_ptr + r * slot_flags + pid
            seen = tl.atomic_add(peer_flag, 0, sem="acquire", scope="sys")
            spins = pid * 0
            while (seen < epoch) & (spins < _MAX_SPINS):
                seen = tl.atomic_add(peer_flag, 0, sem="acquire", scope="sys")
                spins += 1
            if seen < epoch:
                tl.atomic_xchg(flag_ptr + rank * slot_flags + error_index, 1)
        tl.debug_barrier()
        if OP == _SUM:
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(SIZE):
                part = tl.load(data_ptr + r * slot_elems + area + offsets, mask=mask, volatile=True)
                total += part.to(tl.float32)
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
        elif OP == _GATHER:
            for r in tl.static_range(SIZE):
                part = tl.load(data_ptr + r * slot_elems + area + offsets, mask=mask, volatile=True)
                tl.store(out_ptr + r * out_row_stride + offsets, part, mask=mask)
        else:
            part = tl.load(data_ptr + area + offsets, mask=mask, volatile=True)
            tl.store(out_ptr + offsets, part, mask=mask)
