"""Row invariance on CUDA, what makes prefix caching change no answer: inside `gemm.row_invariant()` a GEMM
row and a prefill attention row get the same bits however many rows come with them (a prompt prefilled after
a cached prefix computes a few rows, the same prompt prefilled whole computes many). Prints, for contrast,
how many row counts differ without it."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytestmark = pytest.mark.gpu

from torpor.engine import gemm  # noqa: E402
from torpor.engine.attention.triton_backend import prefill_attention  # noqa: E402

ROWS = [1, 2, 3, 5, 8, 13, 31, 64, 100, 257, 511, 700]


@pytest.fixture(scope="module", autouse=True)
def workspace():
    ws = torch.empty(gemm.workspace_bytes(torch.device("cuda")), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    gemm.set_workspace(stream, ws)
    yield
    gemm.set_workspace(stream, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (12288, 4096), (1024, 151936)])
def test_gemm_rows_do_not_depend_on_the_row_count(dtype, k, n):
    torch.manual_seed(0)
    x = torch.randn(1024, k, dtype=dtype, device="cuda")
    w = torch.randn(n, k, dtype=dtype, device="cuda") / k**0.5
    with gemm.row_invariant():
        whole = gemm.linear(x, w)
        differ = [m for m in ROWS if not torch.equal(gemm.linear(x[-m:].clone(), w), whole[-m:])]
    plain_whole = gemm.linear(x, w)
    plain_differ = [m for m in ROWS if not torch.equal(gemm.linear(x[-m:].clone(), w), plain_whole[-m:])]
    print(f"\n{dtype} k={k} n={n}: row counts whose rows differ from the 1024-row GEMM's: row-invariant "
          f"{differ or 'none'}; per-m heuristic {plain_differ or 'none'}")
    assert not differ
    torch.testing.assert_close(whole, plain_whole, atol=5e-2, rtol=2e-2)  # the same product either way


@pytest.mark.parametrize("context", [64, 300, 2048])
def test_prefill_attention_rows_do_not_depend_on_the_query_count(context):
    """The same queries attend to the same context whole (a prompt prefilled at once) or as a suffix after a
    cached prefix: bit-identical rows."""
    torch.manual_seed(1)
    heads, kv_heads, dim = 32, 8, 128
    q = torch.randn(context, heads, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(context, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    whole = prefill_attention(q, k, v, dim**-0.5)
    differ = [s for s in (1, 2, 7, 16, 63, context - 1) if s < context and not torch.equal(
        prefill_attention(q[-s:].clone(), k, v, dim**-0.5), whole[-s:])]
    # A prefix prefilled alone (fewer keys behind it) gets the bits of the same rows in the longer prefill: its
    # K/V, cached, must equal what the longer prefill computes for them.
    shorter = [s for s in (1, 5, 16, 63, 64, 65, context - 1) if s < context and not torch.equal(
        prefill_attention(q[:s].clone(), k[:s].clone(), v[:s].clone(), dim**-0.5), whole[:s])]
    print(f"\ncontext {context}: rows that differ from the whole prefill's — as a suffix after a cached prefix "
          f"(by suffix length): {differ or 'none'}; as a shorter prefill (by length): {shorter or 'none'}")
    assert not differ and not shorter
    mask = torch.ones(context, context, dtype=torch.bool, device="cuda").tril()  # bottom-right = top-left here
    reference = torch.nn.functional.scaled_dot_product_attention(
        *(t.repeat_interleave(heads // t.shape[1], 1).transpose(0, 1).float() for t in (q, k, v)), attn_mask=mask)
    torch.testing.assert_close(whole.float(), reference.transpose(0, 1), atol=2e-2, rtol=2e-2)


def test_packed_sequences_equal_each_sequence_alone():
    """One varlen call over a packed batch (one sequence whole, one after a cached prefix) gives each sequence
    the bits it gets alone: batch composition changes no answer either."""
    torch.manual_seed(2)
    heads, kv_heads, dim, scale = 16, 4, 128, 128**-0.5
    lens = [(37, 37), (5, 300), (130, 130)]  # (new tokens, context) per sequence
    qs = [torch.randn(q, heads, dim, dtype=torch.bfloat16, device="cuda") for q, _ in lens]
    ks = [torch.randn(c, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _, c in lens]
    vs = [torch.randn(c, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _, c in lens]
    alone = [prefill_attention(q, k, v, scale) for q, k, v in zip(qs, ks, vs, strict=True)]
    cu_q = torch.tensor([0, 37, 42, 172], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 37, 337, 467], dtype=torch.int32, device="cuda")
    packed = prefill_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), scale, cu_q, cu_k, 130, 300)
    assert torch.equal(packed, torch.cat(alone))
