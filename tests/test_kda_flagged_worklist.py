"""The backward's flagged chunks' launches on a persistent grid over their worklist
(`triton_kernels.BACKWARD_FLAGGED_WORKLIST`, CHUNKS "worklist"; `flagged_worklist`): the same values
as the grid of every chunk whose programs return at unflagged ones (CHUNKS "flagged"), bit for bit.
Stages 7, 9b and 10b through a whole Triton backward; stages 9 and 10, whose flagged-only launches
run beside the gluon backend's Gluon kernels (which only the GPU runs), stage by stage on a real
backward's operands, the flagged chunks' rows poisoned first so that a row the launch misses fails."""

from __future__ import annotations

import pytest
import test_kda_parity as parity
import torch
from kda_stage_cases import LAYOUTS, capture_stage, normwise, route_rows
from test_kda_parity import _one_thread  # noqa: F401 (autouse fixture)

from tileport.ops.kda import triton_kernels as kk


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("l2", [True, False])
def test_backward_over_the_worklist_is_bitwise_the_grids(layout, l2, device, seed, monkeypatch):
    """A whole Triton backward (stages 7, 9b and 10b take their flagged chunks in their own launches
    there) with BACKWARD_FLAGGED_WORKLIST off and on: every gradient bitwise equal, and the worklist
    formed once."""
    parity._backend_or_skip("triton", device)
    cu, B, T, (lo, hi) = LAYOUTS[layout]
    K = 32
    q, k, v, g, beta, h0, cu_t = parity.make_inputs(B, T, 2, K, K, torch.bfloat16, cu, True, l2, "normal", "rand",
                                                    device)
    g[0, lo:hi, 0] = -20.0 - 10.0 * torch.rand(hi - lo, K, device=device)  # some chunks flagged, some not
    do = torch.randn_like(v)
    formed = []
    real = kk.flagged_worklist

    def worklist_spy(*args, **kwargs):
        formed.append(real(*args, **kwargs))
        return formed[-1]

    monkeypatch.setattr(kk, "flagged_worklist", worklist_spy)
    grads = []
    for on in (False, True):
        monkeypatch.setattr(kk, "BACKWARD_FLAGGED_WORKLIST", on)
        grads.append(kk.kda_backward_triton(do, None, q, k, v, g, beta, K ** -0.5, h0, l2, cu_t))
    assert len(formed) == 1 and 0 < formed[0][0].item() < formed[0].numel() - 1, "one worklist, some chunks in it"
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[1], grads[0]):
        assert torch.equal(a, b), f"{name} [{layout} l2={l2}]: {normwise(a, b):.2e} normwise from the grid's"


def _poisoned_copy(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[rows] = float("nan")
    return y


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("worklist", [False, True])
@pytest.mark.parametrize("key_block", [32, 64])
def test_stage_9_flagged_launch(layout, worklist, key_block, device, seed, monkeypatch):
    """Stage 9's flagged-only launch (`chunk_dqkwg_kda` with outputs, as beside the Gluon kernel) into
    buffers whose flagged chunks' rows are NaN: every output bitwise the launch over every chunk's;
    at K = 64 in one block of key columns and in two (GDN's DQKWG_KEY_BLOCK, so two items a chunk)."""
    parity._backend_or_skip("triton", device)
    from tileport.ops.gdn import triton_kernels as gdn_tk

    monkeypatch.setattr(gdn_tk, "DQKWG_KEY_BLOCK", key_block)
    args, kwargs = capture_stage("dqkwg", layout, 64, True, device)
    flags, plan = kwargs["span_flags"], args[9]
    flagged = route_rows(plan, flags)[1].to(device)
    ref = kk.chunk_dqkwg_kda(*args, span_flags=flags, fuse_9b=True)
    dp = torch.full((kk._key_split(64)[1], *ref[4].shape), float("nan"), device=device)
    dp[0] = _poisoned_copy(ref[4], flagged)
    outputs = tuple(_poisoned_copy(x, flagged) for x in ref[:4]) + (dp,)
    work = kk.flagged_worklist(flags) if worklist else None
    got = kk.chunk_dqkwg_kda(*args, span_flags=flags, fuse_9b=True, outputs=outputs, worklist=work)
    for name, a, b in zip(("dq", "dk", "dw", "dG", "dP"), got, ref):
        assert torch.equal(a, b), f"{name} [{layout} worklist={worklist}]: {normwise(a, b):.2e}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("worklist", [False, True])
def test_stage_10_flagged_launch(layout, worklist, device, seed):
    """Stage 10's flagged-only launch (`chunk_wy_bwd_kda` only_flagged, as beside the Gluon kernels):
    the flagged chunks' dA, dbeta', dv and in-place dK', dG' bitwise the launch over every chunk's,
    dv's flagged rows poisoned first."""
    parity._backend_or_skip("triton", device)
    args, kwargs = capture_stage("wy_bwd", layout, 64, True, device)
    flags, plan, dv_dtype = kwargs["span_flags"], args[11], args[12]
    flagged = route_rows(plan, flags)[1].to(device)
    Ntok, H, V = args[1].shape

    def run(only_flagged: bool, dv, work=None):
        dkp, dGp = args[9].clone(), args[10].clone()
        outputs_10b = tuple(torch.full_like(x, float("nan")) for x in kwargs["outputs_10b"])
        da, dbp, _ = kk.chunk_wy_bwd_kda(*args[:9], dkp, dGp, *args[11:], span_flags=flags, outputs_10b=outputs_10b,
                                         only_flagged=only_flagged, dv=dv, worklist=work)
        return da, dbp, dv, dkp, dGp

    ref_dv = kk._out((Ntok, H, V), dv_dtype, args[1].device)
    ref = run(False, ref_dv)
    got = run(True, _poisoned_copy(ref_dv, flagged), kk.flagged_worklist(flags) if worklist else None)
    for name, a, b in zip(("dA", "dbeta'"), got[:2], ref[:2]):
        assert torch.equal(a[flagged], b[flagged]), f"{name} [{layout} worklist={worklist}]"
    for name, a, b in zip(("dv", "dK'", "dG'"), got[2:], ref[2:]):
        assert torch.equal(a, b), f"{name} [{layout} worklist={worklist}]: {normwise(a, b):.2e}"
