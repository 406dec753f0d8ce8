"""How far KDA's gradients move from the float64 reference when the backward's per-chunk states are
held in 16 bits, before any kernel is written for it (docs/perf/kda.md, "The backward's states in
bf16, precision first"). The Triton backward runs with its stage 5 (h, Vn) outputs rounded to the
inputs' dtype and back to fp32, as the forward's kept states in 16 bits (KEPT_STATES_DTYPE "bf16",
which the Triton forward does not keep: emulated here), and with stage 8's dh and dVn stored in bf16
(BACKWARD_DSTATES_DTYPE "bf16", the switch itself); the forward and every other stage unchanged:

    fp32          the backward as it is (fp32 h, Vn, dh, dVn, W)
    h-vn          h and Vn rounded (row 48)
    dh-dvn        dh and dVn in bf16 (row 49)
    h-vn+dh-dvn   all four states in 16 bits (FLA's choice: its chunk kernels store h, v_new, dh and
                  dv2 in the inputs' dtype)
    w             the backward's W (formed from the kept T by `chunk_wu_from_t_kda`) rounded to bf16
                  (emulated: no kernel does yet). Not the inputs' dtype, as FLA's recompute of w
                  stores it: for fp16 inputs with steep gates W's factors exp(G) underflow fp16
                  (T100-fp16-verynegative: d initial_state 3.1e-2 normwise against the bound 1e-2,
                  3.3e-4-5.1e-4 with bf16, thirty-first session)
    h-vn+dh-dvn+w all of them

For each 16-bit case of the parity gate (tests/test_kda_parity.py CASES; the "gpu-" ones on a GPU
only) and each of `draws` seeds, the normwise distance of dq, dk, dv, dg, dbeta, dh0 from the
float64 reference, and the gate's bound for each. CPU: TRITON_INTERPRET=1, a few minutes.

    PYTHONPATH=src:tests TRITON_INTERPRET=1 python3 scripts/kda_states_precision.py [draws] [mode,mode,...]
"""

from __future__ import annotations

import sys

import test_kda_parity as parity
import torch

import tileport
from tileport.dispatch import use_backend
from tileport.ops.kda import triton_kernels as kk
from tileport.ops.kda.reference import kda_reference
from tileport.testing import GATE, OUTPUT, bound, rel_error

MODES = ("fp32", "h-vn", "dh-dvn", "h-vn+dh-dvn", "w", "h-vn+dh-dvn+w")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
KINDS = (OUTPUT, OUTPUT, OUTPUT, GATE, GATE, OUTPUT)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(x.dtype)


def _rounding_states(dtype: torch.dtype):
    """Stage 5 with the backward's recompute's h and Vn rounded to dtype (fp32 tensors holding them)."""
    def states(*args, **kwargs):
        h, vn, ht = _REAL_STATES(*args, **kwargs)
        if kwargs.get("for_backward"):
            h, vn = _rounded(h, dtype), _rounded(vn, dtype)
        return h, vn, ht

    return states


def _rounding_w(dtype: torch.dtype):
    """The backward's W from T with W rounded to dtype (an fp32 tensor holding it)."""
    def wu_from_t(*args, **kwargs):
        w, u = _REAL_WU(*args, **kwargs)
        return _rounded(w, dtype), u

    return wu_from_t


_REAL_STATES, _REAL_WU, _DSTATES_DEFAULT = kk.chunk_states, kk.chunk_wu_from_t_kda, kk.BACKWARD_DSTATES_DTYPE


def errors(case_id: str, mode: str, seed: int, device: str) -> list:
    B, T, H, K, V, dt, cu, with_h0, l2, gates, beta_kind, scale = parity.CASES[case_id]
    dtype = parity.DTYPES[dt]
    torch.manual_seed(seed)
    q, k, v, g, beta, h0, cu_t = parity.make_inputs(B, T, H, K, V, dtype, cu, with_h0, l2, gates, beta_kind, device)
    leaves = [q, k, v, g, beta] + ([h0] if h0 is not None else [])
    for t in leaves:
        t.requires_grad_(True)
    parts = mode.split("+")
    kk.chunk_states = _rounding_states(dtype) if "h-vn" in parts else _REAL_STATES
    kk.chunk_wu_from_t_kda = _rounding_w(torch.bfloat16) if "w" in parts else _REAL_WU
    kk.BACKWARD_DSTATES_DTYPE = "bf16" if "dh-dvn" in parts else "fp32"
    try:
        with use_backend("triton", op="kda"):
            o, ht = tileport.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_t)
            torch.manual_seed(seed + 1)
            do, dht = torch.randn_like(o), torch.randn_like(ht)
            grads = torch.autograd.grad([o, ht], leaves, [do, dht])
    finally:
        kk.chunk_states, kk.chunk_wu_from_t_kda, kk.BACKWARD_DSTATES_DTYPE = _REAL_STATES, _REAL_WU, _DSTATES_DEFAULT
    ref_o, ref_ht = kda_reference(q, k, v, g, beta, scale, h0, True, l2, cu_t)
    ref = torch.autograd.grad([ref_o, ref_ht], leaves, [do.double(), dht.double()])
    errs = [rel_error(a, b) for a, b in zip(grads, ref)]
    return errs + [None] * (len(NAMES) - len(errs))  # no dh0 without an initial state

if __name__ == "__main__":
    draws = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else MODES
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(1)
    cases = [c for c, spec in parity.CASES.items() if spec[5] in ("bf16", "fp16")
             and (device == "cuda" or not c.startswith("gpu-"))]
    print(f"device {device}; normwise distance from float64, worst of {draws} draws; bound in brackets")
    worst = {m: 0.0 for m in modes}
    for case_id in cases:
        dtype = parity.DTYPES[parity.CASES[case_id][5]]
        per_mode = {m: [0.0] * len(NAMES) for m in modes}
        for seed in range(draws):
            for mode in modes:
                errs = errors(case_id, mode, 1000 + seed, device)
                per_mode[mode] = [None if b is None else max(a, b) for a, b in zip(per_mode[mode], errs)]
        for mode in modes:
            cells = []
            for name, kind, err in zip(NAMES, KINDS, per_mode[mode]):
                if err is None:
                    continue
                lim = bound(dtype, kind)
                worst[mode] = max(worst[mode], err / lim)
                cells.append(f"{name} {err:.1e} [{lim:.0e}]")
            print(f"{case_id:38} {mode:12} " + "  ".join(cells), flush=True)
    print("worst error / bound per mode: " + ", ".join(f"{m} {w:.2f}" for m, w in worst.items()))
