"""Helpers of the KDA backward-stage tests (tests/test_kda_gluon_stage9.py, test_kda_gluon_wy.py,
test_kda_gluon_dv_local.py): a stage's real arguments captured from a backward, the rows of each
route (chunks stage 3 flags or not), the normwise distance, the plumbing check of a Gluon stage.
Not a test module."""

from __future__ import annotations

import test_kda_parity as parity
import torch

# (cu_seqlens, B, T, the tokens whose gates are steep in head 0: the chunk holding them is flagged,
# the others' logsigmoid(randn) gates ("normal") span ~26-40 about their middle rows: unflagged,
# whole 64-row chunks among them)
LAYOUTS = {
    "dense-B2-T200": (None, 2, 200, (64, 128)),  # batch 0's second chunk; T = 200: a tail chunk of 8
    "varlen-empty-len1": ([0, 1, 1, 130, 200], 1, 200, (70, 120)),  # sequence [1, 130)'s chunk [65, 129)
}

# The keys a backward stage reads, as (l2, triton_kernels.BACKWARD_NORMALISED_QK): the raw 16-bit
# ones (no l2norm), or with l2norm the normalised ones in fp32 or in the inputs' bf16 (the default
# since the thirtieth session)
KEYS = {"raw-keys": (False, "input"), "l2norm-fp32": (True, "fp32"), "l2norm-bf16": (True, "input")}


def capture_stage(stage: str, layout: str, K: int, l2: bool, device: str, normalised_qk: str | None = None):
    """(args, kwargs) of stage 9 ("dqkwg", `chunk_dqkwg_kda`'s), 10 ("wy_bwd", `chunk_wy_bwd_kda`'s),
    7 ("dv_local", `chunk_dv_local_kda`'s) or 8 ("dstates", `chunk_dstates`') in a real backward (`kda_backward_triton`, through its stage parameter): bf16 inputs, K = V,
    H = 2, an initial state; some chunks flagged and some not. Stage 10's in-place inputs (stage 9's
    partials dK', dG', args 9 and 10) are captured as they came in. normalised_qk: the backward's
    BACKWARD_NORMALISED_QK for this capture (None: as it is)."""
    from tileport.ops.kda import triton_kernels as kk

    if normalised_qk is not None:
        default = kk.BACKWARD_NORMALISED_QK
        kk.BACKWARD_NORMALISED_QK = normalised_qk
        try:
            return capture_stage(stage, layout, K, l2, device)
        finally:
            kk.BACKWARD_NORMALISED_QK = default

    cu, B, T, (lo, hi) = LAYOUTS[layout]
    q, k, v, g, beta, h0, cu_t = parity.make_inputs(B, T, 2, K, K, torch.bfloat16, cu, True, l2, "normal", "rand",
                                                    device)
    g[0, lo:hi, 0] = -20.0 - 10.0 * torch.rand(hi - lo, K, device=device)
    real = {"dqkwg": kk.chunk_dqkwg_kda, "wy_bwd": kk.chunk_wy_bwd_kda, "dv_local": kk.chunk_dv_local_kda,
            "dstates": kk.chunk_dstates}[stage]
    captured = []

    def spy(*args, **kwargs):
        if stage == "wy_bwd":
            args = args[:9] + (args[9].clone(), args[10].clone()) + args[11:]
        captured.append((args, kwargs))
        return real(*args, **kwargs)

    kk.kda_backward_triton(torch.randn_like(v), None, q, k, v, g, beta, K ** -0.5, h0, l2, cu_t, **{stage: spy})
    assert len(captured) == 1
    return captured[0]


def route_rows(plan, flags) -> tuple[torch.Tensor, torch.Tensor]:
    """[Ntok, H] masks of the rows of unflagged and of flagged chunks (a chunk: its plan entry's 64
    tokens from bos, cut at its sequence's end eos), on flags' device."""
    pairs = plan.chunks.view(-1, 2).tolist()
    flags = flags.cpu()
    H = flags.shape[1]
    unflagged = torch.zeros(int(plan.cu[-1]), H, dtype=torch.bool)
    flagged = torch.zeros_like(unflagged)
    for c, (bos, eos) in enumerate(pairs):
        rows = slice(bos, min(bos + 64, eos))
        for hh in range(H):
            (unflagged if int(flags[c, hh]) == 0 else flagged)[rows, hh] = True
    return unflagged, flagged


def largest_unflagged_chunk(plan, flags) -> int:
    """The most rows of any unflagged (chunk, head): a case whose unflagged chunks are all one or a
    few rows long would leave the pair terms (zero below the diagonal of a 1-row chunk) untested."""
    pairs = plan.chunks.view(-1, 2).tolist()
    flags = flags.cpu()
    return max((min(64, eos - bos) for c, (bos, eos) in enumerate(pairs) for hh in range(flags.shape[1])
                if int(flags[c, hh]) == 0), default=0)


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def gluon_stage_calls(monkeypatch, switch: str, stage: str) -> list:
    """Plumbing of one Gluon backward stage: with gluon_kernels' `switch` at "gluon" and its stage
    function `stage` (e.g. "chunk_dqkwg_kda_gluon") spied on, `kda_backward_gluon` on the small CPU
    case (test_kda_gluon.plumbing_backward_args) gives Triton's backward's gradients bitwise (off
    the GPU the stage falls back to Triton's); returns the keyword arguments of the stage's calls.
    Skips where the Triton kernels cannot run on the CPU (no TRITON_INTERPRET=1)."""
    import pytest
    from test_kda_gluon import plumbing_backward_args

    from tileport.dispatch import interpreter_enabled
    from tileport.ops.kda import gluon_kernels as gk
    from tileport.ops.kda import triton_kernels as kk

    if not interpreter_enabled():
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    monkeypatch.setattr(gk, switch, "gluon")
    calls = []
    real = getattr(gk, stage)
    monkeypatch.setattr(gk, stage, lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    args = plumbing_backward_args()
    for ours, theirs in zip(gk.kda_backward_gluon(*args), kk.kda_backward_triton(*args)):
        assert torch.equal(ours, theirs)
    return calls


def rounded_as_kernels_round(x16: torch.Tensor, x32: torch.Tensor) -> bool:
    """Whether x16 (bf16) is fp32 x32 rounded as the kernels round it where they store bf16: to
    nearest even, bit for bit, on the GPU; on the CPU the interpreter's emulation
    (`gdn.triton_kernels._op`, Veltkamp splitting in fp32) rounds to nearest but for some ties and
    for fp32 subnormals, so there within half a bf16 ulp (at most 2^-8 relative) plus the subnormal
    step 2^-126 (a truncating store, up to a whole ulp off, fails this on any draw of a few
    thousand values)."""
    if x16.dtype != torch.bfloat16:
        return False
    if x32.is_cuda:
        return torch.equal(x16, x32.to(torch.bfloat16))
    return bool(((x16.float() - x32).abs() <= x32.abs() * 2.0 ** -8 + 2.0 ** -126).all())
