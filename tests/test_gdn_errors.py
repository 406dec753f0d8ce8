"""Bad input to chunk_gated_delta_rule: a clear ValueError/TypeError naming the argument, never a crash."""

import pytest
import torch

import tileport

B, T, H, K, V = 1, 10, 2, 16, 8


def good(**over):
    args = dict(
        q=torch.randn(B, T, H, K),
        k=torch.randn(B, T, H, K),
        v=torch.randn(B, T, H, V),
        g=-torch.rand(B, T, H),
        beta=torch.rand(B, T, H),
    )
    args.update(over)
    return args


def call(**over):
    return tileport.chunk_gated_delta_rule(**good(**over))


CU = torch.tensor([0, 4, 10], dtype=torch.int32)

CASES = [
    # ranks and shapes
    ("q not a tensor", dict(q=[[1.0]]), TypeError, "q"),
    ("q rank 3", dict(q=torch.randn(T, H, K)), ValueError, r"q must have shape \[B, T, H, K\]"),
    ("k shape", dict(k=torch.randn(B, T, H, K + 1)), ValueError, "k must have shape"),
    ("k rank", dict(k=torch.randn(B, T, H * K)), ValueError, "k must have shape"),
    ("v rank", dict(v=torch.randn(B, T, H * V)), ValueError, r"v must have shape \[B, T, H, V\]"),
    ("v heads", dict(v=torch.randn(B, T, H + 1, V)), ValueError, "v must have shape"),
    ("v length", dict(v=torch.randn(B, T + 1, H, V)), ValueError, "v must have shape"),
    ("g shape", dict(g=torch.randn(B, T, H, K)), ValueError, r"g must have shape \[B, T, H\]"),
    ("g length", dict(g=torch.randn(B, T - 1, H)), ValueError, "g must have shape"),
    ("beta shape", dict(beta=torch.rand(B, T)), ValueError, r"beta must have shape \[B, T, H\]"),
    ("initial_state shape", dict(initial_state=torch.randn(B, H, V, K)), ValueError, r"initial_state must have shape \[N, H, K, V\]"),
    ("initial_state batch", dict(initial_state=torch.randn(B + 1, H, K, V)), ValueError, "initial_state"),
    # dtypes
    ("integer q", dict(q=torch.ones(B, T, H, K, dtype=torch.int32)), TypeError, "q must have dtype"),
    ("k dtype differs", dict(k=torch.randn(B, T, H, K).bfloat16()), TypeError, "k has dtype"),
    ("v dtype differs", dict(v=torch.randn(B, T, H, V).half()), TypeError, "v has dtype"),
    ("integer g", dict(g=torch.zeros(B, T, H, dtype=torch.int64)), TypeError, "g must have dtype"),
    ("bool beta", dict(beta=torch.ones(B, T, H, dtype=torch.bool)), TypeError, "beta must have dtype"),
    ("integer initial_state", dict(initial_state=torch.zeros(B, H, K, V, dtype=torch.int32)), TypeError, "initial_state"),
    # head dims
    ("K too large", dict(q=torch.randn(B, T, H, 512), k=torch.randn(B, T, H, 512)), ValueError, "unsupported head dim: K"),
    ("V too large", dict(v=torch.randn(B, T, H, 300)), ValueError, "unsupported head dim: V"),
    ("K zero", dict(q=torch.randn(B, T, H, 0), k=torch.randn(B, T, H, 0)), ValueError, "unsupported head dim: K"),
    # scalars and flags
    ("inf scale", dict(scale=float("inf")), ValueError, "scale"),
    ("scale not a number", dict(scale="0.1"), ValueError, "scale"),
    ("output_final_state not bool", dict(output_final_state=1), TypeError, "output_final_state"),
    ("l2norm flag not bool", dict(use_qk_l2norm_in_kernel="yes"), TypeError, "use_qk_l2norm_in_kernel"),
    # cu_seqlens
    ("cu_seqlens with B != 1", dict(q=torch.randn(2, T, H, K), k=torch.randn(2, T, H, K), v=torch.randn(2, T, H, V),
                                    g=-torch.rand(2, T, H), beta=torch.rand(2, T, H), cu_seqlens=CU),
     ValueError, r"cu_seqlens needs B == 1"),
    ("cu_seqlens not monotone", dict(cu_seqlens=torch.tensor([0, 6, 4, 10])), ValueError, "cu_seqlens must be non-decreasing"),
    ("cu_seqlens not from 0", dict(cu_seqlens=torch.tensor([1, 4, 10])), ValueError, "cu_seqlens must start at 0"),
    ("cu_seqlens not to T", dict(cu_seqlens=torch.tensor([0, 4, 9])), ValueError, "cu_seqlens must end at T"),
    ("cu_seqlens float", dict(cu_seqlens=torch.tensor([0.0, 4.0, 10.0])), TypeError, "cu_seqlens"),
    ("cu_seqlens 2-d", dict(cu_seqlens=torch.tensor([[0, 4, 10]])), ValueError, "cu_seqlens must be a 1-D"),
    ("cu_seqlens too short", dict(cu_seqlens=torch.tensor([0])), ValueError, "cu_seqlens must be a 1-D"),
    ("cu_seqlens not a tensor", dict(cu_seqlens=[0, 4, 10]), TypeError, "cu_seqlens"),
    ("initial_state N != len(cu_seqlens) - 1", dict(cu_seqlens=CU, initial_state=torch.randn(1, H, K, V)), ValueError,
     r"initial_state must have shape \[N, H, K, V\] \(N = len\(cu_seqlens\) - 1\) = \[2,"),
]


@pytest.mark.parametrize("what,over,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(what, over, exc, match):
    with pytest.raises(exc, match=match):
        call(**over)


def test_mixed_devices_named():
    # A meta tensor stands in for "another device" on a CPU-only machine.
    meta = dict(device="meta")
    for name, shape in [("k", (B, T, H, K)), ("v", (B, T, H, V)), ("g", (B, T, H)), ("beta", (B, T, H))]:
        with pytest.raises(ValueError, match=f"{name} is on meta"):
            call(**{name: torch.randn(*shape, **meta)})
    with pytest.raises(ValueError, match="initial_state is on meta"):
        call(initial_state=torch.randn(B, H, K, V, **meta))
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        call(cu_seqlens=torch.tensor([0, 4, 10], **meta))


def test_good_calls_pass():
    o, ht = call()
    assert o.shape == (B, T, H, V) and ht is None
    o, ht = call(cu_seqlens=CU, initial_state=torch.randn(2, H, K, V), output_final_state=True)
    assert o.shape == (B, T, H, V) and ht.shape == (2, H, K, V) and ht.dtype == torch.float32
    o, ht = call(cu_seqlens=torch.tensor([0, 0, 10, 10]), output_final_state=True)  # empty sequences are allowed
    assert ht.shape == (3, H, K, V) and torch.equal(ht[0], torch.zeros(H, K, V))


def test_chunk_plan_index_dtype_and_token_limit():
    from tileport.ops.gdn import triton_kernels as tk

    assert tk.make_plan(2, 100, None, torch.device("cpu")).chunks.dtype == torch.int64  # interpreter: no int32 checks
    assert tk.plan_index_dtype("cuda") == torch.int32  # the GPU: fewer registers
    with pytest.raises(ValueError, match="32-bit"):
        tk.make_plan(1, 2**31, torch.tensor([0, 2**31]), torch.device("cpu"))
