"""Probes for the next decode-speed and start-up work (GPU), each part alone or together:

    python scripts/probe_decode_step.py --part imports      # what `import torch` costs here, bytecode cached?
    python scripts/probe_decode_step.py --part dot-rows     # is a tl.dot row's result independent of its tile?
    python scripts/probe_decode_step.py --part sweep        # the decode kernel's launch configs, GRPO layout
    python scripts/probe_decode_step.py --part ipc          # CUDA IPC open / copy / close per 512 MiB bucket
    python scripts/probe_decode_step.py --part prefix       # the shared-prefix decode kernel against the plain one
    python scripts/probe_decode_step.py --part profile --model DIR   # one late decode step, GRPO shape, by kernel

The GRPO layout: 64 prompts of 512 tokens, n = 8 samples each sharing the prompt's blocks (prefix caching) or
each holding a copy, and per sample 1..256 tokens of its own.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch


def part_imports() -> None:
    code = "import time; t = time.perf_counter(); import torch; print(f'{time.perf_counter() - t:.3f}')"
    times = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
             for _ in range(3)]
    print(f"import torch, three new processes: {times} s")
    print(f"sys.dont_write_bytecode={sys.dont_write_bytecode} PYTHONDONTWRITEBYTECODE="
          f"{os.environ.get('PYTHONDONTWRITEBYTECODE')!r} pycache_prefix={sys.pycache_prefix!r}")
    root = os.path.dirname(torch.__file__)
    pyc = sum(1 for _, _, files in os.walk(root) for f in files if f.endswith(".pyc"))
    py = sum(1 for _, _, files in os.walk(root) for f in files if f.endswith(".py"))
    print(f"torch at {root}: {py} .py, {pyc} .pyc; writable: {os.access(root, os.W_OK)}")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], capture_output=True, text=True)
    rows = []
    for line in out.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0].split(":")[1]), parts[2].rstrip()))
    print("importtime, largest cumulative (us, self us, module):")
    for cum, own, name in sorted(rows, reverse=True)[:25]:
        print(f"  {cum:>9} {own:>9} {name}")
    print("importtime, largest self:")
    for cum, own, name in sorted(rows, key=lambda r: -r[1])[:15]:
        print(f"  {cum:>9} {own:>9} {name}")
    code = ("import time; t = time.perf_counter(); import torch; t1 = time.perf_counter(); "
            "torch.zeros(1, device='cuda'); t2 = time.perf_counter(); import triton; t3 = time.perf_counter(); "
            "print(f'torch {t1 - t:.3f} cuda init {t2 - t1:.3f} triton {t3 - t2:.3f}')")
    print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip())


def part_dot_rows() -> None:
    """A row's result of q @ k^T, exp2, p @ v in one tile, placed at other rows of the tile among other data."""
    import triton
    import triton.language as tl

    @triton.jit
    def tile(q_ptr, k_ptr, v_ptr, o_ptr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        m, n, d = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, D)
        q = tl.load(q_ptr + m[:, None] * D + d[None, :])
        k = tl.load(k_ptr + n[:, None] * D + d[None, :])
        v = tl.load(v_ptr + n[:, None] * D + d[None, :])
        s = tl.dot(q, tl.trans(k)) * 0.12
        p = tl.exp2(s - tl.max(s, axis=1)[:, None])
        o = tl.dot(p.to(tl.bfloat16), v) / tl.sum(p, axis=1)[:, None]
        tl.store(o_ptr + m[:, None] * D + d[None, :], o)

    torch.manual_seed(0)
    d, bn = 128, 64
    k = torch.randn(bn, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(bn, d, device="cuda", dtype=torch.bfloat16)
    row = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    for bm in (16, 32, 64, 128):
        for warps in (4, 8):
            results = []
            for trial in range(6):
                q = torch.randn(bm, d, device="cuda", dtype=torch.bfloat16)
                at = (trial * 7) % bm
                q[at] = row
                o = torch.empty(bm, d, device="cuda", dtype=torch.float32)
                tile[(1,)](q, k, v, o, BM=bm, BN=bn, D=d, num_warps=warps)
                results.append(o[at].clone())
            same = all(torch.equal(results[0], r) for r in results[1:])
            print(f"  BM={bm:>3} warps={warps}: the row equal at 6 positions among other rows: {same}")
            if bm == 64 and warps == 4:
                ref64 = results[0]
            if bm == 16 and warps == 4:
                ref16 = results[0]
    print(f"  BM=16 vs BM=64 (4 warps), the same row: equal {torch.equal(ref16, ref64)}, "
          f"max diff {(ref16 - ref64).abs().max().item():.3e}")


def grpo_inputs(num_prompts: int, n: int, prompt_len: int, max_own: int, shared: bool, num_q_heads: int,
                num_kv_heads: int, head_dim: int = 128, block_size: int = 16, seed: int = 0):
    """q, k_cache, v_cache, block_tables, context_lens of num_prompts x n sequences."""
    gen = torch.Generator().manual_seed(seed)
    own = torch.randint(1, max_own + 1, (num_prompts * n,), generator=gen).tolist()
    prompt_blocks = prompt_len // block_size
    tables, next_block = [], 0
    for p in range(num_prompts):
        base = list(range(next_block, next_block + prompt_blocks))
        next_block += prompt_blocks
        for i in range(n):
            if shared:
                mine = base
            else:
                mine = list(range(next_block, next_block + prompt_blocks))
                next_block += prompt_blocks
            extra = -(-own[p * n + i] // block_size)
            tables.append(mine + list(range(next_block, next_block + extra)))
            next_block += extra
    width = max(map(len, tables)) + 1
    perm = torch.randperm(next_block, generator=gen).tolist()  # blocks scattered over the cache, as in a real one
    bt = torch.tensor([[perm[b] for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv = torch.randn(next_block, 2, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(num_prompts * n, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([prompt_len + o for o in own], dtype=torch.int32)
    return q, kv[:, 0], kv[:, 1], bt.cuda(), lens.cuda()


def _time_config(inputs, heads, block_n: int, warps: int, stages: int, splits: int) -> float:
    import triton
    from triton.testing import do_bench

    from torpor.engine.attention import triton_decode as td

    q, kc, vc, bt, lens = inputs
    out = torch.empty_like(q)
    num_seqs = q.shape[0]
    ws = torch.empty(num_seqs * heads[0] * splits * 129, dtype=torch.float32, device="cuda")
    num_partial = num_seqs * heads[0] * splits * 128
    part, lse = ws[:num_partial], ws[num_partial:]

    def call():
        td._decode_split_kernel[(num_seqs, heads[1], splits)](
            q, kc, vc, bt, lens, out, part, lse, 0.088 * 1.4427, q.stride(0), q.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0), out.stride(0), out.stride(1),
            NUM_Q_HEADS=heads[0], QUERIES_PER_KV=heads[0] // heads[1], HEAD_DIM=128, BLOCK_SIZE=16,
            NUM_SPLITS=splits, BLOCK_H=max(16, triton.next_power_of_2(heads[0] // heads[1])),
            DOT_DTYPE=td._TL_DTYPES[torch.bfloat16], DOT_PRECISION="tf32", BLOCK_N=block_n,
            num_warps=warps, num_stages=stages)
        if splits > 1:
            td._decode_reduce_kernel[(num_seqs, heads[0])](
                part, lse, out, out.stride(0), out.stride(1), NUM_Q_HEADS=heads[0], HEAD_DIM=128,
                NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), num_warps=1)

    return do_bench(call, return_mode="median")


SWEEP = [(64, 4, 2, 1), (64, 4, 3, 1), (64, 4, 4, 1), (32, 4, 2, 1), (32, 4, 3, 1), (128, 4, 2, 1), (128, 8, 2, 1),
         (64, 8, 2, 1), (64, 2, 2, 1), (32, 2, 3, 1), (64, 4, 2, 2), (64, 4, 3, 2), (32, 4, 3, 2), (64, 4, 2, 4)]


def part_sweep() -> None:
    for heads in ((32, 8), (16, 8)):
        for shared in (True, False):
            inputs = grpo_inputs(64, 8, 512, 256, shared, *heads)
            kv_bytes = int(inputs[4].sum()) * heads[1] * 128 * 2 * 2
            print(f"q/kv heads {heads}, {'shared prompt blocks' if shared else 'own copies'}: "
                  f"{kv_bytes / 1e6:.0f} MB of K/V read per call (logical)")
            default = None
            for block_n, warps, stages, splits in SWEEP:
                try:
                    ms = _time_config(inputs, heads, block_n, warps, stages, splits)
                except Exception as e:  # a config ptxas refuses (shared memory) is a row, not the end
                    print(f"  BLOCK_N={block_n:>3} warps={warps} stages={stages} splits={splits}: {type(e).__name__}")
                    continue
                default = default or ms
                print(f"  BLOCK_N={block_n:>3} warps={warps} stages={stages} splits={splits}: {ms * 1e3:7.1f} us "
                      f"({kv_bytes / ms / 1e9:6.0f} GB/s logical, {default / ms:.2f}x the default)")


def part_prefix() -> None:
    """GRPO layout (64 prompts x 512 tokens, n = 8, 1..256 own tokens): the kernel reading each shared prefix
    once per group against every sequence reading its whole context (the plain kernel), prefix caching's layout
    (shared blocks) and caching off's (copies), bit-identity of the two, tile rows and prefix splits."""
    import random

    from triton.testing import do_bench

    from torpor.engine.attention import triton_decode as td

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from references import paged_decode_attention_reference, shared_prefix_decode_inputs

    rng = random.Random(0)
    groups = [(512, [rng.randint(1, 256) for _ in range(8)]) for _ in range(64)]
    for heads in ((32, 8), (16, 8)):
        for rows in (16,):  # 32 and 64 rows were slower on the H200 (docs/engine.md)
            td._PREFIX_ROWS = rows
            members = td.max_group_members(*heads)
            cases = {shared: shared_prefix_decode_inputs(
                groups, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=128, block_size=16,
                dtype=torch.bfloat16, shared=shared, device="cuda", max_group_members=members)
                for shared in (True, False)}
            unique = {shared: sum(int(c[1].shape[0]) for c in [cases[shared]]) * 16 * heads[1] * 128 * 4
                      for shared in cases}
            print(f"heads {heads}, prefix tile {rows} rows ({members} members): K/V blocks held "
                  f"{unique[True] / 1e6:.0f} MB shared, {unique[False] / 1e6:.0f} MB as copies")
            for shared, (q, kc, vc, bt, lens, prefixes) in cases.items():
                out = torch.empty_like(q)
                layout = "shared " if shared else "copies "
                if rows == 16:
                    ms = do_bench(lambda q=q, kc=kc, vc=vc, bt=bt, lens=lens, out=out: td.paged_decode_attention(
                        q, kc, vc, bt, lens, 0.088, out), return_mode="median")
                    print(f"  {layout} plain kernel:                {ms * 1e3:7.1f} us")
                for splits in (1, 2):
                    def call(q=q, kc=kc, vc=vc, bt=bt, lens=lens, out=out, prefixes=prefixes, splits=splits):
                        td.paged_decode_attention(q, kc, vc, bt, lens, 0.088, out, prefixes=prefixes,
                                                  num_prefix_splits=splits)
                    ms = do_bench(call, return_mode="median")
                    print(f"  {layout} prefixes, {splits} prefix split(s): {ms * 1e3:7.1f} us")
            outs = []
            for q, kc, vc, bt, lens, prefixes in cases.values():
                out = torch.empty_like(q)
                td.paged_decode_attention(q, kc, vc, bt, lens, 0.088, out, prefixes=prefixes)
                outs.append(out)
            ref = paged_decode_attention_reference(*cases[True][:5], 0.088)
            error = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
            print(f"  shared == copies bit for bit: {torch.equal(outs[0], outs[1])}; error vs fp32 reference "
                  f"{error:.2e}")
            del cases, outs
            torch.cuda.empty_cache()
    td._PREFIX_ROWS = 16


def _ipc_sender(conn, num: int, nbytes: int) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    buckets = [torch.full((nbytes // 2,), 1.0, dtype=torch.bfloat16, device="cuda") for _ in range(num)]
    torch.cuda.synchronize()
    for b in buckets:
        conn.send(reduce_tensor(b))
        conn.recv()  # the receiver copied and closed it
    conn.close()


def part_ipc() -> None:
    import torch.multiprocessing as mp

    num, nbytes = 30, 512 << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_sender, args=(child, num, nbytes))
    proc.start()
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    opens, copies, closes = [], [], []
    for _ in range(num):
        fn, args = parent.recv()
        t0 = time.perf_counter()
        src = fn(*args)
        t1 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        del src
        t3 = time.perf_counter()
        parent.send(True)
        opens.append(t1 - t0)
        copies.append(t2 - t1)
        closes.append(t3 - t2)
    proc.join()

    def ms(xs):
        xs = sorted(xs[1:])
        return f"median {xs[len(xs) // 2] * 1e3:.3f} ms, max {xs[-1] * 1e3:.3f} ms"

    print(f"ipc, {num} buckets of {nbytes >> 20} MiB: open (rebuild) {ms(opens)}; copy+sync {ms(copies)}; "
          f"release {ms(closes)}")


def part_profile(model: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from torpor.engine import LLM, SamplingParams

    llm = LLM(model, device="cuda", max_model_len=512 + 256 + 1, max_num_seqs=512, max_n=8,
              gpu_memory_utilization=0.85)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, llm.engine.vocab_size, (64, 512), generator=gen).tolist()
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=1.0, seed=i, n=8, max_tokens=256, ignore_eos=True))
    steps = 0
    while steps < 200:
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_device_time_total for e in events)
    print(f"profile {os.path.basename(model)}: 8 decode steps at ~{512 + 200} tokens of context, 512 sequences: "
          f"device {total / 8 / 1e3:.2f} ms per step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {e.self_device_time_total / 8 / 1e3:7.3f} ms/step {e.count // 8:5d} x/step  {e.key[:100]}")
    while engine.has_work():
        engine.step()
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", action="append", required=True,
                        choices=["imports", "dot-rows", "sweep", "ipc", "profile", "prefix"])
    parser.add_argument("--model", action="append", default=[])
    args = parser.parse_args()
    for part in args.part:
        print(f"== {part} ==", flush=True)
        if part == "profile":
            for model in args.model:
                part_profile(model)
        else:
            {"imports": part_imports, "dot-rows": part_dot_rows, "sweep": part_sweep, "ipc": part_ipc,
             "prefix": part_prefix}[part]()


if __name__ == "__main__":
    main()
