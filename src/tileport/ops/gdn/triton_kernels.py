"""Gated DeltaNet, Triton backend: the chunked (WY / UT-transform) algorithm, chunks of 64.

Notation (per sequence and head; `reference.chunked_reference` spells out the algebra): in chunk c,
G is the in-chunk cumulative sum of g, Gam_ts = exp(G_t - G_s) for t >= s, G_L the value at the
chunk's last valid position, h_c the state entering the chunk.

    A     = strict_lower(diag(beta) (K K^T * Gam));   T = (I + A)^-1
    W     = T diag(beta exp(G)) K;     U = T diag(beta) V
    Vn    = U - W h_c
    O     = scale (diag(exp(G)) Q h_c + lower(Q K^T * Gam) Vn)
    h_c+1 = exp(G_L) h_c + (diag(exp(G_L - G)) K)^T Vn

Stages (one kernel launch each; the forward composes 1-3, 5, 6, the backward recomputes 1-5 and
then runs 7-11; stage 4, W and U, is fused into 3). Tokens of all sequences are flattened to
[Ntok, H, D] (Ntok = B*T); a fixed-length batch is the varlen batch cu_seqlens = [0, T, 2T, ...]. The chunk table (first token of each chunk, end of its
sequence) and each sequence's first chunk index are computed on the host (`ChunkPlan`).

     1 l2norm_fwd     (optional) q, k <- x * rsqrt(sum x^2 + 1e-6), stored in the input dtype
                      (fp32 for the backward of 16-bit inputs)
                      (the forward normalises q inside stage 6 instead)
     2 chunk_cumsum   G = in-chunk cumsum of g (fp64)                          grid (NC, H)
     3 chunk_solve_wu T = (I + A)^-1 by 16x16 diagonal blocks (inverted by doubling in registers),
                      merged block-wise; then W, U = T (scaled keys, values) from the blocks.
                      T is stored ([Ntok, H, 64] fp32) only for the backward     grid (NC, H)
     5 chunk_states   sequential over chunks: h_c ([NC, H, K, V]), Vn, final state (fp32)
                                                                               grid (N*H, V/BV)
     6 chunk_output   O; one-shot or persistent (autotuned)             grid (NC*V/BV or SMs, H)
   backward, with dO and dh_T (gradient of the final state):
     7 chunk_dv_local dVl = scale lower(Q K^T * Gam)^T dO                       grid (NC*V/BV, H)
     8 chunk_dstates  sequential, reverse: dh_c+1 (stored), dVn = dVl + diag(exp(G_L-G)) K dh_c+1,
                      dh_c = exp(G_L) dh_c+1 + scale (diag(exp(G)) Q)^T dO - W^T dVn; dh_0
                                                                               grid (N*H, V/BV)
     9 chunk_dqkwg    dQ, dK (partial), dW = -dVn h_c^T, dG (partial)            grid (NC, H)
    10 chunk_wy_bwd   through W, U, T, A: dK, dV, dbeta, dG; dg = reverse in-chunk cumsum of dG
                                                                               grid (NC, H)
    11 l2norm_bwd     (optional) dx = rstd (dy - y (dy . y))

KDA (tileport.ops.kda) reuses stages 1-5 with per-channel gates: `chunk_cumsum`, `chunk_solve_wu`
and `chunk_states` take g / G as [Ntok, H, K] and then launch their kernels with the
PER_CHANNEL constexpr on (kda/triton_kernels.py documents the gate-exponent scheme). With it off
(every GDN call) the kernels compile to exactly the GDN code.

Precision: every matmul accumulates in fp32. In the forward, operands are rounded to bf16 for
bf16 and fp16 inputs (tensor cores; bf16 rather than fp16 because gate products like exp(G) Q
underflow fp16's range with very negative gates), and stay fp32 with input_precision="ieee" for
fp32 inputs (no tf32). The backward of 16-bit inputs keeps the l2-normalised q and k in fp32 and
forms the products that dg and dbeta read (the recompute's recurrence in stage 5, stages 7, 8 and
9 whole, most of 10) from fp32 operands as one tf32 product (`_mm`, "tf32", error <= 2^-10 per
operand instead of bf16's 2^-9; "bf16x3", three bf16 products, ~2^-16, is the option): dg and
dbeta are small differences of large sums (at a chunk's end dg holds exp(G_L) sum(h * dh) over
K*V entries), and bf16 operands there put them past their 3e-2 bound on ~1 in 130 draws of the
gate's K = 128 case (`BACKWARD_PRODUCTS`; docs/perf/gdn.md).
The 16x16 triangular inverses and their block merge are always fp32 "ieee". The gate
cumsum G is kept in fp64 and every exponent is formed as an fp64 difference (G_t - G_s, G_L - G)
before it is rounded to fp32: after a few steps of -20, G is in the hundreds, where an fp32 G
carries an absolute error of ~1e-5 into every exp(G_t - G_s). Measured with 30% of the gates at
-20..-30 and fp32 inputs: fp32 G gave rel errors up to 1e-5 in dg and 7e-6 in dq (the fp32 bound
is 1e-5), fp64 G gives 2e-7 to 5e-7. Exponents use t >= s only and are masked to -inf before exp, so very
negative gates underflow to 0 (never inf * 0). W, U, Vn and h, the intermediates the forward
passes between kernels, are stored in bf16 for 16-bit inputs in the forward (each is rounded to
bf16 as a matmul operand anyway) and in fp32 for fp32 inputs and in the backward's recompute; T,
dh and the partial gradients are fp32. Outputs and gradients are written in their tensor's dtype,
states in fp32.

Under TRITON_INTERPRET=1 (the CPU tests) two things differ from the GPU in triton 3.6, and the code
works around both so that the interpreter computes what the GPU does:
- a bf16 tl.dot is wrong (the interpreter multiplies the raw uint16 storage): there the operands
  are rounded to bf16 in fp32 arithmetic by `_op` and multiplied as fp32 (`DA`), which is what
  the tensor cores compute;
- an fp32 -> bf16 cast truncates instead of rounding to nearest even: kernels round their dot
  operands themselves (`_op`), and bf16 outputs are written as fp32 and rounded by torch (`_out`).
So the bf16 tl.dot and the bf16 stores the GPU runs are not exercised by the CPU tests.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from tileport.devices import sm_count
from tileport.shapes import cdiv, next_pow2
from tileport.dispatch import interpreter_enabled
from tileport.autotuning import configs as autotune_configs, tuned as autotune_candidates
from tileport.memory import new_empty

BT = 64  # chunk size
MAX_HEAD_DIM = 128  # largest K and V the kernels hold in registers
L2NORM_EPS = 1e-6
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_refusal(K: int, V: int, dtype: torch.dtype) -> str | None:
    """None when the Triton kernels accept the problem, else a one-line reason."""
    if dtype not in _SUPPORTED_DTYPES:
        return f"q/k/v dtype {dtype} is not one of float32, float16, bfloat16"
    if K > MAX_HEAD_DIM:
        return f"K={K} is over the Triton kernels' head-dim cap {MAX_HEAD_DIM}"
    if V > MAX_HEAD_DIM:
        return f"V={V} is over the Triton kernels' head-dim cap {MAX_HEAD_DIM}"
    return None


# ----------------------------------------------------------------------------------------
# chunk plan (host)
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    # Index tensors in `plan_index_dtype(device)`: int32 on a GPU (token offsets widen to int64
    # where they meet strides; int64 ones cost the backward kernels 250 B more spills per thread
    # on sm_90a), int64 on the CPU (under the interpreter int32 adds pay for an overflow check each)
    cu: torch.Tensor  # [N+1], token offsets of the sequences in the flattened [Ntok] axis
    chunk_offsets: torch.Tensor  # [N+1], index of each sequence's first chunk
    chunks: torch.Tensor  # [NC, 2], (first token of the chunk, end of its sequence)
    N: int
    NC: int


@functools.lru_cache(maxsize=64)
def _plan_cached(cu: tuple[int, ...], device: str) -> ChunkPlan:
    if cu[-1] >= 2**31:
        raise ValueError(f"{cu[-1]} tokens: the kernels index tokens with 32-bit integers (at most 2**31 - 1)")
    cu_t = torch.tensor(cu, dtype=torch.int64)
    N = len(cu) - 1
    lens = cu_t[1:] - cu_t[:-1]
    nch = (lens + BT - 1) // BT
    offs = torch.zeros(N + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(nch, 0)
    NC = int(offs[-1])
    seq = torch.repeat_interleave(torch.arange(N), nch)
    within = torch.arange(NC) - offs[:-1][seq]
    chunks = torch.stack([cu_t[:-1][seq] + within * BT, cu_t[1:][seq]], dim=1)
    to = functools.partial(torch.Tensor.to, dtype=plan_index_dtype(device), device=device)
    return ChunkPlan(to(cu_t), to(offs), to(chunks).contiguous(), N, NC)


def plan_index_dtype(device) -> torch.dtype:
    return torch.int32 if torch.device(device).type == "cuda" else torch.int64


def make_plan(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkPlan:
    if cu_seqlens is None:
        cu = tuple(b * T for b in range(B + 1))
    else:
        cu = tuple(int(x) for x in cu_seqlens.tolist())
    return _plan_cached(cu, str(device))


def _blocks(K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, NV): K is held whole (padded to a power of two >= 16), V in NV blocks of BV."""
    BK = max(16, next_pow2(K))
    BV = min(64, max(16, next_pow2(V)))
    return BK, BV, cdiv(V, BV)


# The tile solve's smallest key and value block (`_tile_blocks`). K or V of 32 made its W and U
# products [64, 64] x [64, 32] in bf16 (HGMMA 64x32x16 with the B operand MN-major in 64-byte
# swizzle): on the H200 (triton 3.6, 7e672c1) that launch read shared memory past its allocation
# (compute-sanitizer memcheck: 1 KB at the end of the 16 KB block) and the process died with an
# illegal address; no test had run a 16-bit K = 32 on the GPU. Padded to 64, the masked columns are
# zeros and the products take K = 64's layouts, which the GPU gate runs.
TILE_MIN_BLOCK = 64


def _tile_blocks(K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, NV) for `_solve_wu_tile_kernel`: `_blocks`'s, each at least TILE_MIN_BLOCK."""
    BK, BV, _ = _blocks(K, V)
    BK, BV = max(BK, TILE_MIN_BLOCK), max(BV, min(TILE_MIN_BLOCK, 64))
    return BK, BV, cdiv(V, BV)


def _dot_types(dtype: torch.dtype) -> tuple:
    """(DT, DA) for the kernels' matmul operands: rounded to DT, handed to tl.dot as DA.

    DT is fp32 for fp32 inputs and bf16 for both 16-bit input dtypes: operands such as
    exp(G) Q or W carry gate products that reach 1e-9 and below with very negative gates, which
    fp16 flushes to zero (bf16 has fp32's exponent range). The interpreter's bf16 tl.dot is wrong
    in triton 3.6, so there bf16 operands go in as fp32 (rounded to bf16 by `_op`)."""
    DT = tl.float32 if dtype == torch.float32 else tl.bfloat16
    DA = tl.float32 if interpreter_enabled() else DT
    return DT, DA


# The backward's products for 16-bit inputs: "tf32" (fp32 operands, one tf32 tensor-core product
# each), "bf16x3" (fp32 operands, three bf16 products each) or "bf16" (the forward's: operands
# rounded to bf16); the recompute's solve keeps its tf32x3 whatever this says. With "bf16", dbeta
# and dg of the frozen gate's K128-bf16-l2 case exceeded their 3e-2 bound on ~1 in 130 fresh draws
# (3.2e-2, 4.1e-2, 3.0e-2 seen, CI included); the stages that mattered were states (h), dqkwg,
# dstates, wy_bwd and stage 1's bf16 keys (docs/perf/gdn.md, "The gate gradients' precision").
# "bf16x3" fixed that but cost the backward 8.18 -> 15.30 ms at S1 (H200, 667cd8c); "tf32" since
# then: on those three draws dg <= 0.06 and dbeta <= 0.18 of their bounds with tf32 emulated by
# truncation on the CPU (bf16: up to 1.37 and 1.07). Read at each call, so a benchmark can time each.
BACKWARD_PRODUCTS = "tf32"
# Per-stage exceptions to BACKWARD_PRODUCTS ("bf16", "tf32" or "bf16x3" by stage name: "keys" (the
# normalised q, k the backward keeps), "states" (the recompute's recurrence), "dv_local",
# "dstates", "dqkwg", "wy_bwd"), for measuring which stages need the fp32 operands. KDA's backward
# shares "states" (its recompute runs GDN's chunk_states) and otherwise reads BACKWARD_PRODUCTS.
BACKWARD_PRODUCTS_BY_STAGE: dict = {}
BACKWARD_STAGES = ("keys", "states", "dv_local", "dstates", "dqkwg", "wy_bwd")
_BACKWARD_FORMS = ("bf16", "tf32", "bf16x3")


def _checked(name: str, value, forms, what: str = "forms"):
    """value, if it is one of the switch `name`'s forms; a ValueError naming them otherwise."""
    if value not in forms:
        raise ValueError(f"{name} {value!r}: {what} are {tuple(forms)}")
    return value


def _emulated_here(prec: str) -> str:
    """prec as this machine runs it: "tf32" / "bf16x3" are formed explicitly under the
    interpreter ("...-emulated"), whose tl.dot ignores input_precision."""
    return prec + "-emulated" if prec in ("tf32", "bf16x3") and interpreter_enabled() else prec


def _products(dtype: torch.dtype, for_backward: bool = False, stage: str | None = None) -> tuple:
    """(DT, DA, PREC) for a kernel's matmuls on inputs of `dtype`: `_dot_types` (the rounding of
    every plain tl.dot's operands) and the precision PREC of the products that go through `_mm`:
    "ieee" (rounded like the rest) in the forward and for fp32 inputs; BACKWARD_PRODUCTS ("tf32"
    or "bf16x3") in the backward of 16-bit inputs ("...-emulated" under the interpreter, whose
    tl.dot ignores input_precision and would multiply fp32 operands exactly)."""
    for name in BACKWARD_PRODUCTS_BY_STAGE:
        _checked("BACKWARD_PRODUCTS_BY_STAGE", name, BACKWARD_STAGES, what="stages")
    prec = _checked("BACKWARD_PRODUCTS" if stage not in BACKWARD_PRODUCTS_BY_STAGE else "BACKWARD_PRODUCTS_BY_STAGE",
                    BACKWARD_PRODUCTS_BY_STAGE.get(stage, BACKWARD_PRODUCTS), _BACKWARD_FORMS)
    if for_backward and dtype != torch.float32 and prec in ("bf16x3", "tf32"):
        return (*_dot_types(dtype), _emulated_here(prec))
    return (*_dot_types(dtype), "ieee")


# ----------------------------------------------------------------------------------------
# kernels
#
# Written for the CPU interpreter as much as for the GPU. Under TRITON_INTERPRET=1 every call of
# a @triton.jit function from inside a kernel re-patches triton.language (~2 ms a call), and
# tl.sum / tl.cumsum / tl.zeros are such functions; so the kernels mostly call builtins (tl.dot,
# tl.where, tl.full, ...), index with plain offset arithmetic, and call tl.sum outside loops. The
# one helper is `_op`, which every matmul operand goes through: rounded to DT, the input dtype
# (what the tensor cores see), and handed to tl.dot as DA (= DT, except bf16 under the
# interpreter: fp32, rounded by bits). The backward multiplies through `_mm`, whose precision
# PREC is "ieee" (the operands' exact products) or, for the backward of 16-bit inputs, "tf32"
# or "bf16x3" on fp32 operands (`_products`).
# Row offsets into [Ntok, H, D] tensors are int64 (`row` = token * H + head).
# ----------------------------------------------------------------------------------------


# Autotune candidates (tileport.autotuning): every one timed on the card at the first call of a
# new (K, V, H, dtypes), the first only under the interpreter. Picked on the card, not guessed
# here: the H200 profile (2026-11-29) showed the states kernel latency-bound with 256 programs, and
# which block of V and how many stages hide that best is a measurement. tests/test_gdn_tuning.py
# runs every candidate under the interpreter.
_configs, _tuned = autotune_configs, autotune_candidates


def _programs_bucket(n: int) -> int:
    """The sequential kernels' autotune key NH_BUCKET (not read by their bodies): the number of
    (sequence, head) pairs, rounded up to a power of two. The best block of V depends on how many
    programs fill the card (S1: 128 pairs; B=1 T=32768: 16, where only small blocks of V give the
    132 SMs work), and the bucket keeps varlen batches from re-tuning at every new count."""
    return next_pow2(max(1, n))


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    """Streaming multiprocessors of `device` (the persistent kernels' grid); 4 on the CPU, where
    the interpreter runs the persistent form's loop over several items per program."""
    if torch.device(device).type != "cuda":
        return 4
    return sm_count(device)


SOLVE_WU_OPTIONS = (dict(num_warps=8, num_stages=1), dict(num_warps=4, num_stages=1))
STATES_OPTIONS = (dict(BV=64, num_warps=4, num_stages=1), dict(BV=32, num_warps=4, num_stages=1),
                  dict(BV=64, num_warps=4, num_stages=2), dict(BV=32, num_warps=4, num_stages=2),
                  dict(BV=64, num_warps=8, num_stages=2), dict(BV=16, num_warps=4, num_stages=2))
# the reverse recurrence of the backward: 4 warps spill 160 B at K = V = 128 (sm_90a), 8 none; no
# pipelining (its fp32 tiles at 2 stages would not leave room in shared memory)
DSTATES_OPTIONS = (dict(BV=64, num_warps=8, num_stages=1), dict(BV=64, num_warps=4, num_stages=1),
                   dict(BV=32, num_warps=4, num_stages=1), dict(BV=16, num_warps=4, num_stages=1))
# PER_SM = 0: one (chunk, V block) per program; PER_SM = 1: one persistent program per SM striding
# over them, its loads pipelined num_stages deep (see `_output_kernel`). Two stages take 116 KB
# (BV=64) and 161 KB (BV=128) of shared memory at K = V = 128 (sm_90a), so one such CTA per SM.
OUTPUT_OPTIONS = (dict(BV=64, PER_SM=0, num_warps=4, num_stages=1), dict(BV=128, PER_SM=0, num_warps=4, num_stages=1),
                  dict(BV=128, PER_SM=0, num_warps=8, num_stages=1), dict(BV=64, PER_SM=0, num_warps=8, num_stages=1),
                  dict(BV=128, PER_SM=1, num_warps=8, num_stages=2), dict(BV=64, PER_SM=1, num_warps=4, num_stages=2),
                  dict(BV=128, PER_SM=1, num_warps=4, num_stages=2))


@triton.jit
def _op(x, DT: tl.constexpr, DA: tl.constexpr):
    """x as a tl.dot operand: rounded to DT. When DA != DT (bf16 under the interpreter) x is rounded
    to bf16's 8 significant bits by Veltkamp splitting (c = x (2^16 + 1); x_hi = c - (c - x):
    round to nearest, ties to even but for a few ties) and kept in fp32: the interpreter's own
    fp32 -> bf16 cast truncates, and its bf16 dot is wrong (see the module docstring)."""
    if DA == DT:
        r = x.to(DT)
    else:
        c = x.to(tl.float32) * 65537.0
        r = c - (c - x.to(tl.float32))
    return r


@triton.jit
def _tf32_truncated(x):
    """fp32 x cut to tf32 (sign, exponent, the top 10 mantissa bits; -8192 = 0xFFFFE000): what the
    tensor cores read of an fp32 operand when nothing rounds it first, the coarser of the two
    roundings a tf32 product may see. The interpreter's stand-in for input_precision="tf32"."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _mm(a, b, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr):
    """a @ b for fp32 a and b, fp32 accumulate, at precision PREC: "ieee" (the operands rounded
    to DT by `_op`, then multiplied exactly: what every other tl.dot here does), "bf16x3" (a and b
    kept fp32, each split as x = hi + lo, hi = bf16(x), lo = bf16(x - hi), and multiplied as
    lo.hi + hi.lo + hi.hi on bf16 tensor cores: triton's own decomposition; relative error ~2^-16
    per product against bf16 operands' 2^-9, for 3x the tensor-core work and the registers of
    fp32 operands), "tf32" (one tensor-core product of the fp32 operands' top 10 mantissa bits:
    error <= 2^-10 per operand truncated, 2^-11 rounded; a third of bf16x3's tensor-core work),
    or "bf16x3-emulated" / "tf32-emulated": the same products formed explicitly under the interpreter, whose tl.dot
    ignores input_precision (bf16x3's splits rounded to nearest as `_op` does; tf32 truncated).
    The backward calls it for the products that dg and dbeta depend on (`_products`)."""
    if PREC == "bf16x3-emulated":
        ca = a * 65537.0
        ah = ca - (ca - a)
        al = a - ah
        ca = al * 65537.0
        al = ca - (ca - al)
        cb = b * 65537.0
        bh = cb - (cb - b)
        bl = b - bh
        cb = bl * 65537.0
        bl = cb - (cb - bl)
        r = tl.dot(al, bh, input_precision="ieee") + tl.dot(ah, bl, input_precision="ieee")
        r = tl.dot(ah, bh, r, input_precision="ieee")
    elif PREC == "tf32-emulated":
        r = tl.dot(_tf32_truncated(a), _tf32_truncated(b), input_precision="ieee")
    elif PREC == "bf16x3" or PREC == "tf32":
        r = tl.dot(a, b, input_precision=PREC)
    else:
        r = tl.dot(_op(a, DT, DA), _op(b, DT, DA), input_precision=PREC)
    return r


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _l2norm_fwd_kernel(x_ptr, y_ptr, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """1: y = x * rsqrt(sum(x^2) + eps) over rows of D, stored in y's dtype."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    m = (rows < n_rows)[:, None] & (d < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) + eps)
    tl.store(y_ptr + offs, (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=m)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _l2norm_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n_rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """11: dx = rstd (dy - y (dy . y)), y and rstd recomputed from x."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    m = (rows < n_rows)[:, None] & (d < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) + eps)
    y = x * rstd[:, None]
    dx = rstd[:, None] * (dy - y * tl.sum(dy * y, 1)[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _cumsum_kernel(g_ptr, G_ptr, chunks_ptr, H, BT: tl.constexpr,
                   PER_CHANNEL: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """2: G = cumulative sum of g inside the chunk, in fp64 (see the module docstring). With
    PER_CHANNEL (KDA) g and G are [Ntok, H, K] and each key channel is summed on its own."""
    c = tl.program_id(0)
    hh = tl.program_id(1)
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    tok = bos + tl.arange(0, BT)
    valid = tok < eos
    row = tok.to(tl.int64) * H + hh
    if PER_CHANNEL:
        kc = tl.arange(0, BK)
        mk = valid[:, None] & (kc < K)[None, :]
        offs = row[:, None] * K + kc[None, :]
        g = tl.load(g_ptr + offs, mask=mk, other=0.0).to(tl.float64)
        tl.store(G_ptr + offs, tl.cumsum(g, 0), mask=mk)
    else:
        g = tl.load(g_ptr + row, mask=valid, other=0.0).to(tl.float64)
        tl.store(G_ptr + row, tl.cumsum(g, 0), mask=valid)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _unit_lower_inverse16(N, eye, PREC: tl.constexpr):
    """(I + N)^-1 for strictly lower triangular 16x16 fp32 N ([16, 16], or a batch [B, 16, 16]
    with eye shaped alike), by doubling: (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8), exact
    because N^16 = 0. Six dependent 16x16 products instead of the 15 row steps of forward
    substitution (each a shuffle of the tile through shared memory): the chain's latency is what
    the solve kernel waited on (H200 profile, 2026-11-29). The products at PREC (`_tile_dot`): fp32
    "ieee" (on FMA units), or "tf32" (tensor cores; "tf32-emulated" under the interpreter)."""
    N2 = _tile_dot(N, N, PREC, tl.float32, tl.float32)
    N4 = _tile_dot(N2, N2, PREC, tl.float32, tl.float32)
    N8 = _tile_dot(N4, N4, PREC, tl.float32, tl.float32)
    P = eye - N
    P += _tile_dot(P, N2, PREC, tl.float32, tl.float32)
    P += _tile_dot(P, N4, PREC, tl.float32, tl.float32)
    P += _tile_dot(P, N8, PREC, tl.float32, tl.float32)
    return P


@triton.jit
def _rounded_as(x, ptr, DA: tl.constexpr):
    """fp32 x rounded to ptr's element type and kept in fp32: what storing it there and loading
    it back would give (bf16 by `_op`, since the interpreter's bf16 cast truncates)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        y = _op(x, tl.bfloat16, DA)
    elif ptr.dtype.element_ty == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _load_keys(k_ptr, offs, mask, eps, L2NORM: tl.constexpr, DA: tl.constexpr):
    """A [rows, BK] tile of keys in fp32 (BK covers K: whole rows). L2NORM: x * rsqrt(sum x^2 +
    eps) rounded to k's dtype, the value stage 1 (`_l2norm_fwd_kernel`) would have stored, so a
    kernel that normalises its own keys computes what it would from stage 1's output."""
    k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        k = _rounded_as(k * tl.rsqrt(tl.sum(k * k, 1) + eps)[:, None], k_ptr, DA)
    return k


@triton.jit
def _rounded_for(x, ptr, DA: tl.constexpr):
    """x as stored into ptr: rounded to bf16 by `_op` when ptr holds bf16 (the interpreter's own
    fp32 -> bf16 cast truncates), unchanged otherwise."""
    if ptr.dtype.element_ty == tl.bfloat16:
        y = _op(x, tl.bfloat16, DA)
    else:
        y = x
    return y


# lint: allow-function TP001,TP007 -- [16, K] block rows of [T, H, K] tensors, `_solve_wu_kernel`'s: a TMA port belongs to the Gluon backend (issue 5)
@triton.jit
def _wu_by_blocks(k_ptr, v_ptr, G_ptr, w_ptr, u_ptr, Ts, bs, gs, vs, rows, kc, K: tl.constexpr, V: tl.constexpr,
                  BV: tl.constexpr, NV: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                  PER_CHANNEL: tl.constexpr, EXACT_WU: tl.constexpr):
    """`_solve_wu_kernel`'s W and U from its T blocks Ts (row-major, j <= i), by block rows: W_i =
    sum_{j <= i} T_ij diag(beta exp(G)) K_j and U_i = sum_{j <= i} T_ij diag(beta) V_j, the keys
    and values of block j reloaded for each row i >= j (L1/L2 hits) rather than held: keeping all
    four blocks live through the solve spilled registers."""
    WT: tl.constexpr = tl.float32 if EXACT_WU else DT  # W/U operand rounding (see EXACT_WU)
    WA: tl.constexpr = tl.float32 if EXACT_WU else DA
    Tops = ()  # T's blocks as matmul operands (rounded to WT, as a stored-and-reloaded T would be)
    for t in tl.static_range(len(Ts)):
        Tops = Tops + (_op(Ts[t], WT, WA),)
    for i in tl.static_range(NB):
        mk = vs[i][:, None] & (kc < K)[None, :]
        for j in tl.static_range(i + 1):
            mkj = vs[j][:, None] & (kc < K)[None, :]
            kj = tl.load(k_ptr + rows[j][:, None] * K + kc[None, :], mask=mkj, other=0.0).to(tl.float32)
            if PER_CHANNEL:
                Gj = tl.load(G_ptr + rows[j][:, None] * K + kc[None, :], mask=mkj, other=0.0)
                kw = _op(kj * tl.exp(Gj.to(tl.float32)) * bs[j], WT, WA)
            else:
                kw = _op(kj * (bs[j] * tl.exp(gs[j].to(tl.float32))[:, None]), WT, WA)
            if j == 0:
                w = tl.dot(Tops[(i * (i + 1)) // 2], kw, input_precision="ieee")
            else:
                w += tl.dot(Tops[(i * (i + 1)) // 2 + j], kw, input_precision="ieee")
        tl.store(w_ptr + rows[i][:, None] * K + kc[None, :], _rounded_for(w, w_ptr, DA), mask=mk)
    for jv in tl.static_range(NV):
        vc = jv * BV + tl.arange(0, BV)
        for i in tl.static_range(NB):
            mv = vs[i][:, None] & (vc < V)[None, :]
            for j in tl.static_range(i + 1):
                mvj = vs[j][:, None] & (vc < V)[None, :]
                vj = tl.load(v_ptr + rows[j][:, None] * V + vc[None, :], mask=mvj, other=0.0).to(tl.float32)
                if j == 0:
                    u = tl.dot(Tops[(i * (i + 1)) // 2], _op(vj * bs[j], WT, WA), input_precision="ieee")
                else:
                    u += tl.dot(Tops[(i * (i + 1)) // 2 + j], _op(vj * bs[j], WT, WA), input_precision="ieee")
            tl.store(u_ptr + rows[i][:, None] * V + vc[None, :], _rounded_for(u, u_ptr, DA), mask=mv)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.autotune(configs=_tuned(SOLVE_WU_OPTIONS), key=["K", "V", "H", "PER_CHANNEL", "STORE_T", "EXACT_WU",
                                                       "FACTORED_DIAGONAL", "ONLY_FLAGGED", "WITH_WU"])
@triton.jit
def _solve_wu_kernel(k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr, chunks_ptr, H,
                     K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                     BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     STORE_T: tl.constexpr, EXACT_WU: tl.constexpr, FACTORED_DIAGONAL: tl.constexpr = False,
                     SPAN_MAX: tl.constexpr = 40.0, ONLY_FLAGGED: tl.constexpr = False, flags_ptr=None,
                     WITH_WU: tl.constexpr = True):
    """3: T = (I + A)^-1, A = strict_lower(diag(beta) (K K^T * Gam)), then W = T diag(beta exp(G)) K
    and U = T diag(beta) V, for one chunk and head; grid (NC, H). T never leaves registers unless
    STORE_T (the backward reads it): the forward saves T's round trip through HBM and the
    reload of k that a separate W/U kernel paid. EXACT_WU: the W and U products take fp32
    operands ("ieee") instead of DT-rounded ones; the backward's recompute sets it, because dg
    is far more sensitive to W and U than o is (a bf16 draw at K=128 had dg at 3.9e-2 with
    rounded operands here and 1.7e-2 with exact ones, o unchanged; docs/perf/gdn.md).

    In 16x16 blocks (NB = BT / 16 per side), chosen by hand where Triton would take the whole
    64x64 tile: block row i forms A_im (m <= i) from the keys, inverts its diagonal block
    (`_unit_lower_inverse16`), then T_ij = -T_ii sum_{j <= m < i} A_im T_mj for j < i. W and U rows
    of block i are sum_{j <= i} T_ij X_j (X = the scaled keys or values of block j): the zero
    blocks above the diagonal are never multiplied. T, when stored, is [64 rows, 64 cols] fp32 with
    zeros above the diagonal blocks; W and U go out in their buffers' dtype (bf16 for the forward
    of 16-bit inputs, fp32 for the backward's recompute).

    PER_CHANNEL (KDA): G is [Ntok, H, K] and A_ts = beta_t sum_c k_tc k_sc exp(G_tc - G_sc). An
    off-diagonal block (m < i) is one dot with the reference point r = first row of block i:
    (k_t exp(G_t - G_r)) . (k_s exp(G_r - G_s)), both exponents <= 0 for g <= 0; a diagonal block
    uses the exact pairwise differences as a [16, 16, BK] fp32 product (no factor can overflow for
    any gate magnitude; kda.reference.gated_products is the same scheme in float64);
    W = T diag(beta) (exp(G) * K). FACTORED_DIAGONAL: a diagonal block whose gates span at most
    SPAN_MAX (max abs(G_s - G_r) over its rows and channels, checked at run time) is one dot of the
    same reference-row factors instead (KDA's DIAGONAL_FORM; kda/triton_kernels.py says why).
    ONLY_FLAGGED: only the chunks whose flag the tile kernel set, those whose gates span too much
    for its whole-chunk factors, from their worklist at flags_ptr (`flagged_worklist`) on a
    persistent grid (P,): an empty launch is then P programs that read a count, where a grid (NC, H)
    of programs returning at their flag cost ~14 us at S1 (H200, its CTAs' launch rate).
    WITH_WU = False: T alone (with STORE_T; KDA's forward that forms Vn from T), w_ptr and u_ptr
    untouched."""
    tl.static_assert(WITH_WU or STORE_T, "T alone is stored T")
    if ONLY_FLAGGED:  # a persistent grid over the worklist: its programs take every num_programs-th item
        # (a while loop: as a for loop the body spilled, sm_90a: 1020 B against 104 without a loop)
        i = tl.program_id(0)
        n = tl.load(flags_ptr)
        while i < n:
            item = tl.load(flags_ptr + 1 + i)
            i += tl.num_programs(0)
            _solve_wu_chunk(item // H, item % H, k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr, chunks_ptr, H,
                            K, V, BK, BV, NV, BT, DT, DA, PER_CHANNEL, STORE_T, EXACT_WU, FACTORED_DIAGONAL, SPAN_MAX,
                            WITH_WU)
    else:
        _solve_wu_chunk(tl.program_id(0), tl.program_id(1), k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr,
                        chunks_ptr, H, K, V, BK, BV, NV, BT, DT, DA, PER_CHANNEL, STORE_T, EXACT_WU, FACTORED_DIAGONAL,
                        SPAN_MAX, WITH_WU)


# lint: allow-function TP001,TP007 -- [16, K] block rows of [T, H, K] tensors, `_solve_wu_kernel`'s: a TMA port belongs to the Gluon backend (issue 5)
@triton.jit
def _solve_wu_chunk(c, hh, k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr, chunks_ptr, H,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                    BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, PER_CHANNEL: tl.constexpr,
                    STORE_T: tl.constexpr, EXACT_WU: tl.constexpr, FACTORED_DIAGONAL: tl.constexpr,
                    SPAN_MAX: tl.constexpr, WITH_WU: tl.constexpr):
    """`_solve_wu_kernel`'s work for chunk c of head hh."""
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    NB: tl.constexpr = BT // 16
    CB: tl.constexpr = 32 if BK > 32 else BK  # key channels per slice of a per-channel diagonal block
    r = tl.arange(0, 16)
    kc = tl.arange(0, BK)
    cols = tl.arange(0, BT)
    strict = r[:, None] > r[None, :]
    bs = ()
    gs = ()
    vs = ()
    rows = ()
    for b in tl.static_range(NB):
        tok = bos + b * 16 + r
        valid = tok < eos
        row = tok.to(tl.int64) * H + hh
        bs = bs + (tl.load(beta_ptr + row, mask=valid, other=0.0).to(tl.float32)[:, None],)
        if not PER_CHANNEL:  # (per-channel [16, K] gate tiles are reloaded where used, not held)
            gs = gs + (tl.load(G_ptr + row, mask=valid, other=0.0),)
        vs = vs + (valid,)
        rows = rows + (row,)
    Ts = ()  # the blocks T_ij, j <= i, row-major
    for i in tl.static_range(NB):
        A_row = ()
        if PER_CHANNEL:
            tr = bos + i * 16  # the reference row r of block i
            r_ok = tr < eos
            Gr = tl.load(G_ptr + (tr.to(tl.int64) * H + hh) * K + kc, mask=r_ok & (kc < K), other=0.0)
            mki = vs[i][:, None] & (kc < K)[None, :]
            ki = tl.load(k_ptr + rows[i][:, None] * K + kc[None, :], mask=mki, other=0.0).to(tl.float32)
            Gi = tl.load(G_ptr + rows[i][:, None] * K + kc[None, :], mask=mki, other=0.0)
            xi = _op(ki * tl.exp(tl.where(vs[i][:, None], (Gi - Gr[None, :]).to(tl.float32), float("-inf"))), DT, DA)
        for m in tl.static_range(i + 1):
            msk = vs[i][:, None] & vs[m][None, :]
            if m == i:
                msk = msk & strict
            if PER_CHANNEL:
                if m == i:
                    span = tl.max(tl.max(tl.where(mki, tl.abs(Gi - Gr[None, :]), 0.0), 1), 0)
                    if FACTORED_DIAGONAL and span <= SPAN_MAX:
                        ek = tl.where(vs[i][:, None] & r_ok, (Gr[None, :] - Gi).to(tl.float32), float("-inf"))
                        kk = tl.dot(xi, tl.trans(_op(ki * tl.exp(ek), DT, DA)), input_precision="ieee")
                    else:
                        # [16, 16, CB] products over CB key channels at a time: the whole [16, 16, K]
                        # fp32 tile (and the four [16, K] fp64 gate tiles it was held beside) spilled
                        # 2.6-6.4 KB per thread on sm_90a (ptxas, 2026-11-29)
                        kk = tl.full([16, 16], 0.0, tl.float32)
                        for cb in tl.static_range(0, BK, CB):
                            cc = cb + tl.arange(0, CB)
                            mkc = vs[i][:, None] & (cc < K)[None, :]
                            kci = tl.load(k_ptr + rows[i][:, None] * K + cc[None, :], mask=mkc, other=0.0).to(tl.float32)
                            Gci = tl.load(G_ptr + rows[i][:, None] * K + cc[None, :], mask=mkc, other=0.0)
                            keep = (msk[:, :, None]) & (cc < K)[None, None, :]
                            e3 = tl.exp(tl.where(keep, (Gci[:, None, :] - Gci[None, :, :]).to(tl.float32), float("-inf")))
                            kk += tl.sum(kci[:, None, :] * kci[None, :, :] * e3, 2)
                else:
                    mkm = vs[m][:, None] & (kc < K)[None, :]
                    km = tl.load(k_ptr + rows[m][:, None] * K + kc[None, :], mask=mkm, other=0.0).to(tl.float32)
                    Gm = tl.load(G_ptr + rows[m][:, None] * K + kc[None, :], mask=mkm, other=0.0)
                    ek = tl.where(vs[m][:, None] & r_ok, (Gr[None, :] - Gm).to(tl.float32), float("-inf"))
                    kk = tl.dot(xi, tl.trans(_op(km * tl.exp(ek), DT, DA)), input_precision="ieee")
                A_row = A_row + (tl.where(msk, kk * bs[i], 0.0),)
            else:
                # both key blocks reloaded (L1 hits) rather than held: a [16, K] dot operand is
                # replicated in every warp, and four of them held through the solve spilled
                ki = tl.load(k_ptr + rows[i][:, None] * K + kc[None, :], mask=vs[i][:, None] & (kc < K)[None, :], other=0.0)
                km = tl.load(k_ptr + rows[m][:, None] * K + kc[None, :], mask=vs[m][:, None] & (kc < K)[None, :], other=0.0)
                kk = tl.dot(_op(ki, DT, DA), tl.trans(_op(km, DT, DA)), input_precision="ieee")
                gam = tl.exp(tl.where(msk, (gs[i][:, None] - gs[m][None, :]).to(tl.float32), float("-inf")))  # 0 off the mask
                A_row = A_row + (kk * bs[i] * gam,)
        Tii = _unit_lower_inverse16(A_row[i], tl.where(r[:, None] == r[None, :], 1.0, 0.0), "ieee")
        for j in tl.static_range(i):
            acc = tl.dot(A_row[j], Ts[(j * (j + 1)) // 2 + j], input_precision="ieee")
            for m in tl.static_range(j + 1, i):
                acc += tl.dot(A_row[m], Ts[(m * (m + 1)) // 2 + j], input_precision="ieee")
            Ts = Ts + (-tl.dot(Tii, acc, input_precision="ieee"),)
        Ts = Ts + (Tii,)
    if WITH_WU:
        _wu_by_blocks(k_ptr, v_ptr, G_ptr, w_ptr, u_ptr, Ts, bs, gs, vs, rows, kc, K, V, BV, NV, NB, DT, DA,
                      PER_CHANNEL, EXACT_WU)
    if STORE_T:
        for i in tl.static_range(NB):
            base = Ai_ptr + rows[i][:, None] * BT
            for j in tl.static_range(i + 1):
                tl.store(base + (j * 16 + r)[None, :], _rounded_for(Ts[(i * (i + 1)) // 2 + j], Ai_ptr, DA),
                         mask=vs[i][:, None])
            if i + 1 < NB:
                tl.store(base + cols[None, :], tl.full([16, BT], 0.0, tl.float32),
                         mask=vs[i][:, None] & (cols >= (i + 1) * 16)[None, :])



# the last: three CTAs per SM by a cap on registers. With the diagonal inverses on tensor cores
# (NORMALISED_KEYS_DIAG_PREC "tf32") the forward's form needs ~184 registers uncapped and spills
# 0-64 B at 168 (sm_90a, 4 warps, by form); on the H200 (fab5903, log row 26) it is then the fastest, 0.306 ms at
# S1 against 0.375 uncapped (a cap at 128, four CTAs, 0.328; with fp32 inverses every cap lost).
SOLVE_WU_TILE_OPTIONS = (dict(num_warps=8, num_stages=1), dict(num_warps=4, num_stages=1),
                         dict(num_warps=4, num_stages=1, maxnreg=168))


@triton.jit
def _tile_dot(a, b, PREC: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr):
    """a @ b for the tile solve's fp32 [64, 64] tiles at PREC: "bf16" (both rounded to bf16 by
    `_op`, then one bf16 tensor-core pass; under the interpreter the rounding is explicit, so the CPU
    gate sees what the GPU computes), "tf32-emulated" (the interpreter's one-pass tf32, truncated
    as `_mm` does), else tl.dot's own input_precision ("tf32", "tf32x3", "ieee")."""
    if PREC == "bf16":
        r = tl.dot(_op(a, DT, DA), _op(b, DT, DA), input_precision="ieee")
    elif PREC == "tf32-emulated":
        r = tl.dot(_tf32_truncated(a), _tf32_truncated(b), input_precision="ieee")
    else:  # not through `_mm`: its rounding casts, no-ops here, cost this kernel spills (ptxas, sm_90a)
        r = tl.dot(a, b, input_precision=PREC)
    return r


# lint: allow-function TP001,TP007 -- a [64, K] chunk tile of G [T, H, K] (fp64), as the solve kernels load it: varlen tails would need a descriptor per sequence
@triton.jit
def _chunk_gate_span(G_ptr, row, mk, bos, eos, H, hh, kc, K: tl.constexpr, BT: tl.constexpr):
    """(d, span) for a chunk of per-channel gates (G [Ntok, H, K] fp64): d = G - G_m in fp32, [BT,
    BK], m the chunk's middle row (bos + (n - 1) // 2 for its n = min(eos - bos, BT) rows: eos is
    its sequence's end, not the chunk's), 0 off the mask; span = max abs(d). Where span <= 60,
    exp(d) and exp(-d) are finite in bf16 and fp32. One definition for the solve and the output
    kernel: the output kernel reads the solve's flag, so both must mean the same chunk by it."""
    d, _ = _chunk_gate_offsets(G_ptr, row, mk, bos, eos, H, hh, kc, K, BT)
    return d, tl.max(tl.max(tl.abs(d), 1), 0)


# lint: allow-function TP007 -- one program over int8 flags and a scattered int32 store: nothing to vectorise
@triton.jit
def _flagged_worklist_kernel(flags_ptr, work_ptr, n, BLOCK: tl.constexpr):
    """The worklist of the flagged routes' persistent launches from stage 3's flags (int8 [NC, H],
    n = NC * H entries): work[0] = how many are set, work[1 + i] = the index c * H + hh of the i-th
    set one, in increasing order (a prefix sum a block at a time); grid (1,)."""
    count = 0
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        f = (tl.load(flags_ptr + idx, mask=idx < n, other=0) != 0).to(tl.int32)
        tl.store(work_ptr + 1 + count + tl.cumsum(f, 0) - f, idx, mask=f != 0)
        count += tl.sum(f, 0)
    tl.store(work_ptr, count)


def flagged_worklist(span_flags: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [1 + NC * H]: the count of stage 3's flagged (chunk, head) pairs, then their indices
    c * H + hh (`_flagged_worklist_kernel`), for the flagged routes' persistent launches; formed
    into out where given (a forward forms it once, after stage 3, for every flagged launch)."""
    flags = span_flags.contiguous().view(-1)
    if out is not None and (out.shape != (1 + flags.numel(),) or out.dtype != torch.int32
                            or out.device != flags.device):
        raise ValueError(f"worklist_out must be int32 [{1 + flags.numel()}] on {flags.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    work = torch.empty(1 + flags.numel(), dtype=torch.int32, device=flags.device) if out is None else out
    # one pass at S1 (NC * H = 8192): 1024 a pass took 9.7 us on the H200, eight dependent passes
    block = min(next_pow2(max(flags.numel(), 1)), 8192)
    _flagged_worklist_kernel[(1,)](flags, work, flags.numel(), BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return work


# Programs an SM of a flagged route's persistent launch (read at each call). H200 at ebc8d8b (S1,
# the gluon forward under no_grad, one process): 2 / 8 / 32 took 0.913 / 0.915 / 0.920 ms with
# logsigmoid gates (no chunk flagged) and 10.10 / 10.07 / 10.04 with steep ones (every chunk);
# one CTA a chunk had taken 9.90 ms there in another run (docs/perf/kda.md row 32).
WORKLIST_PROGRAMS_PER_SM = 2


def worklist_programs(device, items: int) -> int:
    """The persistent grid of a flagged route's launch: WORKLIST_PROGRAMS_PER_SM programs an SM (4
    programs on the CPU), at most one per item and at least one."""
    per_sm = WORKLIST_PROGRAMS_PER_SM if torch.device(device).type == "cuda" else 1
    return max(1, min(items, _sm_count(device) * per_sm))


@triton.jit
def _not_this_route(CHUNKS: tl.constexpr, flags_ptr, c, H, hh):
    """Whether chunk c of head hh is left to the other launch of a kernel that KDA's whole-chunk
    form (DIAGONAL_FORM "chunk") launches twice on stage 3's per-chunk flags (int8 [NC, H]): CHUNKS
    "whole" takes the unflagged chunks, "flagged" the others, "all" (one launch) every chunk."""
    if CHUNKS == "whole":
        other = tl.load(flags_ptr + c * H + hh) != 0
    elif CHUNKS == "flagged":
        other = tl.load(flags_ptr + c * H + hh) == 0
    else:
        other = False
    return other


@triton.jit
def _chunk_middle_gates(G_ptr, bos, eos, H, hh, kc, K: tl.constexpr, BT: tl.constexpr):
    """G_m [len(kc)]: the gates of the chunk's middle row m (as `_chunk_gate_span` takes it) for
    the key channels kc, in G's dtype; d = G - G_m are the whole-chunk forms' factors."""
    m = bos + (tl.minimum(eos - bos, BT) - 1) // 2
    return tl.load(G_ptr + (m.to(tl.int64) * H + hh) * K + kc, mask=kc < K, other=0.0)


# lint: allow-function TP001,TP007 -- a [64, K] chunk tile of G [T, H, K] (fp64), as the solve kernels load it: varlen tails would need a descriptor per sequence
@triton.jit
def _chunk_gate_offsets(G_ptr, row, mk, bos, eos, H, hh, kc, K: tl.constexpr, BT: tl.constexpr):
    """(d, G_m): d = G - G_m in fp32 for the key channels kc (all of them or a block; mk masks rows
    and channels), m the chunk's middle row as `_chunk_gate_span` takes it; G_m fp64 [len(kc)]
    (G = d + G_m to fp32's rounding, so a kernel need not load G again for exp(G))."""
    Gm = _chunk_middle_gates(G_ptr, bos, eos, H, hh, kc, K, BT)
    Gt = tl.load(G_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
    return tl.where(mk, (Gt - Gm[None, :]).to(tl.float32), 0.0), Gm


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.autotune(configs=_tuned(SOLVE_WU_TILE_OPTIONS), key=["K", "V", "H", "STORE_T", "EXACT_WU", "L2NORM_K", "WITH_WU",
                                                            "STORE_KN", "CUMSUM_G", "PREC", "T_CHAIN", "DIAG_PREC",
                                                            "PER_CHANNEL"])
@triton.jit
def _solve_wu_tile_kernel(k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr, chunks_ptr, H,
                          K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                          BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, PREC: tl.constexpr,
                          STORE_T: tl.constexpr, EXACT_WU: tl.constexpr, eps=1e-6, L2NORM_K: tl.constexpr = False,
                          WITH_WU: tl.constexpr = True, kn_ptr=None, STORE_KN: tl.constexpr = False,
                          g_ptr=None, CUMSUM_G: tl.constexpr = False, T_CHAIN: tl.constexpr = "horner",
                          DIAG_PREC: tl.constexpr = "ieee", PER_CHANNEL: tl.constexpr = False, flags_ptr=None,
                          SPAN_MAX: tl.constexpr = 60.0):
    """3, the same T, W and U as `_solve_wu_kernel`, in whole [64, 64] tiles rather than a chain
    of 16x16 blocks; grid (NC, H).

    A = strict_lower(diag(beta) (K K^T * Gam)) is one [64, K] x [K, 64] product. Its four
    diagonal 16x16 blocks are taken out as a batch [4, 16, 16] (a reshape to [4, 16, 4, 16] and a
    masked sum) and inverted together by doubling (batched "ieee" products), giving D =
    blockdiag((I + A_ii)^-1). With M = D A_off (A_off: A below the diagonal blocks, so M^4 = 0),
    (I + A) = (I + A_diag)(I + M) gives T = (I + M)^-1 D = (I - M + M^2 - M^3) D, by Horner:
    four [64, 64] products. W and U are each one [64, 64] x [64, K or BV] product with T.

    Why: the block form is 16 dependent 16x16 products for T and 20 [16, 16] x [16, K] ones for
    W and U, each moving its operands between layouts through shared memory; on the H200 that
    chain made the kernel 0.75 ms at S1 (7x its memory floor; profile at 5031cf0). Here the
    chain is 7 batched 16x16 products, 4 [64, 64] ones and 1 + NV output products, each of 64
    rows (a full MMA tile for 4 warps). Explicit where Triton would choose: the 16-row diagonal
    blocks (their inverse must be exact, and 16^3 per block is cheap on FMA units); PREC, the
    precision of the fp32 [64, 64] products (`_tile_dot`): "tf32x3" (three tf32 tensor-core passes,
    error near fp32's) for 16-bit inputs, one-pass "tf32" or "bf16" for the forward's normalised
    keys (NORMALISED_KEYS_PREC), "ieee" for fp32 inputs. EXACT_WU and STORE_T as in
    `_solve_wu_kernel`. L2NORM_K: k is raw and each load normalises it (`_load_keys`), so stage 1
    need not write the normalised keys (L2NORM_K_FORM "in-kernel" and "stage-3"); STORE_KN: it also
    stores them to kn_ptr, as stage 1 would have (L2NORM_K_FORM "stage-3": the states kernel reads
    them, and stage 1's kernel is not launched; with PER_CHANNEL the two come together, and a
    flagged chunk stores its keys before it returns: KDA's KEYS_NORMALISED_IN "stage-3"). CUMSUM_G: stage 2 here too (CUMSUM_FORM
    "stage-3"): G is the in-chunk cumulative sum of the raw gates at g_ptr, formed as
    `_cumsum_kernel` forms it and stored to G_ptr for the states kernel. WITH_WU = False (WU_FORM
    "split"): T alone, stored (STORE_T) in Ai's dtype, and `_wu_from_t_kernel` forms W and U.

    PER_CHANNEL (KDA's DIAGONAL_FORM "chunk": the forward and the backward's recompute): G is [Ntok, H, K] and
    A_ts = beta_t sum_c k_tc k_sc exp(G_tc - G_sc) is one product of factors taken through the
    chunk's middle row m: (k_t exp(G_t - G_m)) . (k_s exp(G_m - G_s)). Where a chunk's gates span
    at most SPAN_MAX about m (max abs(G_t - G_m) over its rows and channels, checked here) every
    factor is below exp(SPAN_MAX) = 1.1e26, finite in bf16, and the lower triangle's terms are the
    exact ones up to the factors' rounding (no term is ever larger than abs(k_t k_s)); the upper
    triangle may overflow and is masked out. A steeper chunk is left alone (the program returns):
    its flag (int8, one per chunk and head, at flags_ptr) is set and `_solve_wu_kernel`
    (ONLY_FLAGGED) forms it in 16-row blocks. W = T diag(beta) (exp(G) * K). With CUMSUM_G the
    per-channel G is formed here from g [Ntok, H, K] and stored for every chunk, flagged or not,
    before anything reads it."""
    c, hh, bos, eos, r, tok, valid, row, kc, vc0, mk, mv0 = _chunk_program(chunks_ptr, H, K, V, BK, BV, 1, BT, tl.program_id(0))
    NB: tl.constexpr = BT // 16
    tl.static_assert(NB == 4, "M^NB = 0 ends the series for T at M^3 only when NB = 4")
    if PER_CHANNEL:
        tl.static_assert(STORE_KN == L2NORM_K, "per-channel gates: keys normalised here are stored, for the flagged "
                                               "chunks' block kernel too")
        if CUMSUM_G:
            # stage 2 here too (KDA's CUMSUM_FORM "stage-3"), in 32-channel blocks: the whole [64, 128]
            # fp64 scan in registers spilled 1.4 KB per thread at 4 warps (sm_90a). G is read back
            # below, from L2 (this program's own stores) rather than from HBM as stage 2's output
            for cb in tl.static_range(0, BK, 32):
                cc = cb + tl.arange(0, 32)
                gk = row[:, None] * K + cc[None, :]
                mkc = valid[:, None] & (cc < K)[None, :]
                tl.store(G_ptr + gk, tl.cumsum(tl.load(g_ptr + gk, mask=mkc, other=0.0).to(tl.float64), 0), mask=mkc)
            tl.debug_barrier()  # the sums stored by every thread before any reads them back
        d, span = _chunk_gate_span(G_ptr, row, mk, bos, eos, H, hh, kc, K, BT)
        tl.store(flags_ptr + c * H + hh, tl.where(span <= SPAN_MAX, 0, 1).to(tl.int8))
        if span > SPAN_MAX:  # left to the block kernel
            if STORE_KN:  # which reads this chunk's keys from kn, as every later stage does
                tl.store(kn_ptr + row[:, None] * K + kc[None, :],
                         _load_keys(k_ptr, row[:, None] * K + kc[None, :], mk, eps, L2NORM_K, DA).to(kn_ptr.dtype.element_ty),
                         mask=mk)
            return
    b = tl.load(beta_ptr + row, mask=valid, other=0.0).to(tl.float32)
    # scalar gates (per-channel ones were read, or formed, above as d)
    if CUMSUM_G and not PER_CHANNEL:  # `_cumsum_kernel`'s sum (fp64, the same order), zero past the chunk's end as loaded
        g = tl.cumsum(tl.load(g_ptr + row, mask=valid, other=0.0).to(tl.float64), 0)
        tl.store(G_ptr + row, g, mask=valid)
        g = tl.where(valid, g, 0.0)
    elif not PER_CHANNEL:
        g = tl.load(G_ptr + row, mask=valid, other=0.0)
    kd = _load_keys(k_ptr, row[:, None] * K + kc[None, :], mk, eps, L2NORM_K, DA)
    if STORE_KN:  # the values stage 1 stores (`_load_keys` rounds as it does): exact in kn's dtype
        tl.store(kn_ptr + row[:, None] * K + kc[None, :], kd.to(kn_ptr.dtype.element_ty), mask=mk)
    if PER_CHANNEL:
        d = tl.where(mk, d, 0.0)
        kk = tl.dot(_op(kd * tl.exp(d), DT, DA), tl.trans(_op(kd * tl.exp(-d), DT, DA)), input_precision="ieee")
        strict = (r[:, None] > r[None, :]) & valid[:, None] & valid[None, :]
        A = tl.where(strict, kk * b[:, None], 0.0)
    else:
        kd = _op(kd, DT, DA)
        kk = tl.dot(kd, tl.trans(kd), input_precision="ieee")
        strict = (r[:, None] > r[None, :]) & valid[:, None] & valid[None, :]
        A = kk * b[:, None] * tl.exp(tl.where(strict, (g[:, None] - g[None, :]).to(tl.float32), float("-inf")))
    # the diagonal blocks as a batch, inverted; then D = blockdiag of the inverses as [64, 64]
    blk = tl.arange(0, NB)
    same = blk[:, None, None, None] == blk[None, None, :, None]  # [NB, 1, NB, 1]
    Ad = tl.sum(tl.where(same, tl.reshape(A, [NB, 16, NB, 16]), 0.0), 2)  # [NB, 16, 16]
    r16 = tl.arange(0, 16)
    eye16 = tl.where(r16[:, None] == r16[None, :], 1.0, 0.0)
    Dd = _unit_lower_inverse16(Ad, tl.broadcast_to(eye16[None, :, :], [NB, 16, 16]), DIAG_PREC)
    D = tl.reshape(tl.where(same, tl.reshape(Dd, [NB, 16, 1, 16]), 0.0), [BT, BT])
    M = _tile_dot(D, tl.where((r[:, None] // 16) > (r[None, :] // 16), A, 0.0), PREC, DT, DA)
    if T_CHAIN == "factored":
        # T = (I + M^2)(I - M) D: M D and M^2 are independent, so the chain after M is two
        # dependent products instead of Horner's three (four tiles live instead of three)
        Y = D - _tile_dot(M, D, PREC, DT, DA)
        Tm = Y + _tile_dot(_tile_dot(M, M, PREC, DT, DA), Y, PREC, DT, DA)
    else:
        Tm = D  # Horner: T = (I - M + M^2 - M^3) D = D - M (D - M (D - M D)), three tiles live
        for _ in tl.static_range(NB - 1):
            Tm = D - _tile_dot(M, Tm, PREC, DT, DA)
    if WITH_WU:
        WT: tl.constexpr = tl.float32 if EXACT_WU else DT  # W/U operand rounding (see _solve_wu_kernel)
        WA: tl.constexpr = tl.float32 if EXACT_WU else DA
        Top = _op(Tm, WT, WA)
        # k loaded again (an L1/L2 hit) rather than held through the solve: registers
        kt = _load_keys(k_ptr, row[:, None] * K + kc[None, :], mk, eps, L2NORM_K, DA)
        if PER_CHANNEL:  # G loaded again, as the block kernel forms W's operand
            Gt = tl.load(G_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
            kw = kt * tl.exp(Gt.to(tl.float32)) * b[:, None]
        else:
            kw = kt * (b * tl.exp(g.to(tl.float32)))[:, None]
        w = _tile_dot(Top, _op(kw, WT, WA), PREC, WT, WA)
        tl.store(w_ptr + row[:, None] * K + kc[None, :], _rounded_for(w, w_ptr, DA), mask=mk)
        for jv in tl.static_range(NV):
            vc = jv * BV + tl.arange(0, BV)
            mv = valid[:, None] & (vc < V)[None, :]
            vt = tl.load(v_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
            u = _tile_dot(Top, _op(vt * b[:, None], WT, WA), PREC, WT, WA)
            tl.store(u_ptr + row[:, None] * V + vc[None, :], _rounded_for(u, u_ptr, DA), mask=mv)
    if STORE_T:
        tl.store(Ai_ptr + row[:, None] * BT + r[None, :], _rounded_for(Tm, Ai_ptr, DA), mask=valid[:, None])


# lint: allow-function TP001,TP007 -- [64, 64] chunk tiles of [T, H, D] tensors, as in the solve kernels: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence
@triton.jit
def _wu_from_t_kernel(t_ptr, x_ptr, beta_ptr, G_ptr, out_ptr, chunks_ptr, H, D: tl.constexpr, BC: tl.constexpr,
                      NCB: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, GATED: tl.constexpr,
                      PER_CHANNEL: tl.constexpr = False, PREC: tl.constexpr = None, CHUNKS: tl.constexpr = "all",
                      flags_ptr=None):
    """3b (WU_FORM "split"): one [64, BC] column block of W = T diag(beta exp(G)) K (GATED) or of
    U = T diag(beta) V for a chunk, from the T that `_solve_wu_tile_kernel` stored in bf16 (WITH_WU
    = False); grid (NC * NCB, H), NCB blocks of BC columns of D. The same rounding as the fused form
    (T and the scaled tile rounded to bf16, fp32 accumulation, the result rounded as stored), so
    W and U are the fused form's. Explicit where Triton would choose: the column blocks, which
    give every chunk NCB independent programs instead of one serial chain.

    KDA's backward from the T its forward kept (docs/perf/kda.md row 19): PER_CHANNEL, G is
    [Ntok, H, D] and W = T (diag(beta) (exp(G) * K)), the gate per element; PREC (not None): T
    (fp32) and the scaled tile stay fp32 and the product is `_tile_dot` at PREC, as the backward's
    recompute forms its W and U (EXACT_WU); CHUNKS ("whole" / "flagged", `_not_this_route` on
    stage 3's flags) launches it once per route, so that each route's chunks get about the
    precision their recompute had (the tile kernel's PREC; tf32x3 for the block kernel's fp32)."""
    # the chunk program with D as its "V" and the column blocks as its V blocks: cols, m
    c, hh, bos, eos, r, tok, valid, row, _, cols, _, m = _chunk_program(chunks_ptr, H, D, D, BC, BC, NCB, BT,
                                                                        tl.program_id(0))
    if _not_this_route(CHUNKS, flags_ptr, c, H, hh):
        return
    t = tl.load(t_ptr + row[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    f = tl.load(beta_ptr + row, mask=valid, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if GATED and PER_CHANNEL:
        x = x * tl.exp(tl.load(G_ptr + row[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32))
    elif GATED:
        f = f * tl.exp(tl.load(G_ptr + row, mask=valid, other=0.0).to(tl.float32))
    if PREC is None:
        y = tl.dot(_op(t, DT, DA), _op(x * f[:, None], DT, DA), input_precision="ieee")
    else:
        y = _tile_dot(t, x * f[:, None], PREC, DT, DA)
    tl.store(out_ptr + row[:, None] * D + cols[None, :], _rounded_for(y, out_ptr, DA), mask=m)


@triton.jit
def _chunk_program(chunks_ptr, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   NV: tl.constexpr, BT: tl.constexpr, item):
    """What work item `item` (in 0 .. NC * NV, grid axis 0 of the chunk-parallel kernels, whose
    axis 1 is the head) covers: chunk c, head hh, V block j; the chunk's tokens [bos, eos), rows,
    the [Ntok, H] row offsets, column ranges and the [BT, K] / [BT, BV] masks."""
    c = item // NV
    j = item % NV
    hh = tl.program_id(1)
    bos = tl.load(chunks_ptr + 2 * c)
    eos = tl.load(chunks_ptr + 2 * c + 1)
    r = tl.arange(0, BT)
    tok = bos + r
    valid = tok < eos
    row = tok.to(tl.int64) * H + hh
    kc = tl.arange(0, BK)
    vc = j * BV + tl.arange(0, BV)
    mk = valid[:, None] & (kc < K)[None, :]
    mv = valid[:, None] & (vc < V)[None, :]
    return c, hh, bos, eos, r, tok, valid, row, kc, vc, mk, mv


@triton.jit
def _sequence_program(cu_ptr, choff_ptr, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      BT: tl.constexpr):
    """What a program of the sequential kernels (5 and 8; grid (N*H, V/BV)) works on: its sequence
    n and head hh, the sequence's tokens [bos, eos), its first chunk c0 and chunk count nc, and the
    ranges, mask and offsets of its [BK, BV] block of a [K, V] state."""
    nh = tl.program_id(0)
    j = tl.program_id(1)
    n = nh // H
    hh = nh % H
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    c0 = tl.load(choff_ptr + n)
    nc = (eos - bos + BT - 1) // BT
    r = tl.arange(0, BT)
    kc = tl.arange(0, BK)
    vc = j * BV + tl.arange(0, BV)
    smask = (kc < K)[:, None] & (vc < V)[None, :]
    sblk = kc[:, None] * V + vc[None, :]
    return n, hh, bos, eos, c0, nc, r, kc, vc, smask, sblk


@triton.jit
def _state_or_zeros(ptr, n, hh, H, sblk, smask, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, PRESENT: tl.constexpr):
    """This program's [BK, BV] block of state (n, hh) of a [N, H, K, V] tensor in fp32, or zeros
    when there is no such tensor (no initial state; no gradient of the final state)."""
    if PRESENT:
        x = tl.load(ptr + (n.to(tl.int64) * H + hh) * (K * V) + sblk, mask=smask, other=0.0).to(tl.float32)
    else:
        x = tl.full([BK, BV], 0.0, tl.float32)
    return x


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.autotune(configs=_tuned(STATES_OPTIONS), key=["K", "V", "H", "NH_BUCKET", "PER_CHANNEL", "FUSE_OUTPUT",
                                                     "L2NORM_K"])
@triton.jit
def _states_kernel(k_ptr, w_ptr, u_ptr, G_ptr, h0_ptr, h_ptr, vn_ptr, ht_ptr, cu_ptr, choff_ptr, H, NH_BUCKET,
                   q_ptr, o_ptr, scale, eps,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                   HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                   PER_CHANNEL: tl.constexpr, FUSE_OUTPUT: tl.constexpr, L2NORM_Q: tl.constexpr,
                   L2NORM_K: tl.constexpr = False, PREC: tl.constexpr = "ieee"):
    """5: one program per (V block, sequence, head), sequential over the sequence's chunks.
    h [BK, BV] fp32 stays in registers; per chunk it is stored (the state entering the chunk, in
    h_ptr's dtype: bf16 for the forward of 16-bit inputs, where only the output kernel reads it),
    Vn = U - W h is formed and stored, and h <- exp(G_L) h + (diag(exp(G_L - G)) K)^T Vn.
    PER_CHANNEL (KDA): h <- diag(exp(G_L)) h + (exp(G_L - G) * K)^T Vn, G_L in R^K.

    FUSE_OUTPUT (GDN's forward, 5 and 6 in one): instead of storing h and Vn, each chunk's output
    O = scale (diag(exp(G)) Q h + lower(Q K^T * Gam) Vn) is formed right here from the h and Vn in
    registers, rounded as the output kernel would see them after a bf16 round trip (`_op`), and
    stored; q and o are [Ntok, H, K] / [Ntok, H, V], q raw when L2NORM_Q. Why: h and Vn are
    0.8 GB written and read back at S1, the larger half of the forward's bytes (docs/perf/gdn.md,
    "Path to issue 5's 0.46 ms"). Q K^T is formed once per V block. L2NORM_K: k is raw and
    normalised on load (`_load_keys`), as in `_solve_wu_tile_kernel`. PREC: `_mm`'s precision for
    the recurrence's two products (the backward's recompute: BACKWARD_PRODUCTS on fp32 operands)."""
    n, hh, bos, eos, c0, nc, r, kc, vc, smask, sblk = _sequence_program(cu_ptr, choff_ptr, H, K, V, BK, BV, BT)
    h = _state_or_zeros(h0_ptr, n, hh, H, sblk, smask, K, V, BK, BV, HAS_H0)
    for i in range(0, nc):
        if not FUSE_OUTPUT:
            tl.store(h_ptr + ((c0 + i).to(tl.int64) * H + hh) * (K * V) + sblk, _rounded_for(h, h_ptr, DA), mask=smask)
        tok = bos + i * BT + r
        valid = tok < eos
        row = tok.to(tl.int64) * H + hh
        mk = valid[:, None] & (kc < K)[None, :]
        mv = valid[:, None] & (vc < V)[None, :]
        w = tl.load(w_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
        u = tl.load(u_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        vn = u - _mm(w.to(tl.float32), h, PREC, DT, DA)
        last = tl.minimum(bos + i * BT + BT, eos) - 1
        k = _load_keys(k_ptr, row[:, None] * K + kc[None, :], mk, eps, L2NORM_K, DA)
        if PER_CHANNEL:
            GL = tl.load(G_ptr + (last.to(tl.int64) * H + hh) * K + kc, mask=kc < K, other=0.0)
            G = tl.load(G_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
            kd = k * tl.exp(tl.where(mk, (GL[None, :] - G).to(tl.float32), float("-inf")))
            hdecay = tl.exp(GL.to(tl.float32))[:, None]
        else:
            GL = tl.load(G_ptr + last.to(tl.int64) * H + hh)
            G = tl.load(G_ptr + row, mask=valid, other=0.0)
            kd = k * tl.exp(tl.where(valid, (GL - G).to(tl.float32), float("-inf")))[:, None]
            hdecay = tl.exp(GL.to(tl.float32))
        if FUSE_OUTPUT:
            vnd = _op(_rounded_for(vn, vn_ptr, DA), DT, DA)  # Vn as the output kernel would read it
            q = tl.load(q_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
            if L2NORM_Q:
                qf = q.to(tl.float32)
                q = _rounded_as(qf * tl.rsqrt(tl.sum(qf * qf, 1) + eps)[:, None], q_ptr, DA)
            q = _op(q, DT, DA)
            m = valid[:, None] & valid[None, :] & (r[:, None] >= r[None, :])
            gam = tl.exp(tl.where(m, (G[:, None] - G[None, :]).to(tl.float32), float("-inf")))
            P = tl.where(m, tl.dot(q, tl.trans(_op(k, DT, DA)), input_precision="ieee") * gam, 0.0)
            o = (tl.dot(q, _op(_rounded_for(h, h_ptr, DA), DT, DA), input_precision="ieee")
                 * tl.exp(G.to(tl.float32))[:, None]
                 + tl.dot(_op(P, DT, DA), vnd, input_precision="ieee"))
            tl.store(o_ptr + row[:, None] * V + vc[None, :], (o * scale).to(o_ptr.dtype.element_ty), mask=mv)
        else:
            tl.store(vn_ptr + row[:, None] * V + vc[None, :], _rounded_for(vn, vn_ptr, DA), mask=mv)
        h = h * hdecay + _mm(tl.trans(kd), vn, PREC, DT, DA)
    if STORE_FINAL:
        tl.store(ht_ptr + (n.to(tl.int64) * H + hh) * (K * V) + sblk, h, mask=smask)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.autotune(configs=_tuned(OUTPUT_OPTIONS), key=["K", "V", "H"])
@triton.jit
def _output_kernel(q_ptr, k_ptr, G_ptr, h_ptr, vn_ptr, o_ptr, chunks_ptr, H, NC, scale, eps,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                   DT: tl.constexpr, DA: tl.constexpr, L2NORM_Q: tl.constexpr, PER_SM: tl.constexpr):
    """6: O = scale (diag(exp(G)) Q h_c + lower(Q K^T * Gam) Vn), in o's dtype, for the work items
    (chunk, V block) 0 .. NC * V/BV of head program_id(1); grid (programs, H).
    PER_SM = 0: one item per program (programs = n_items). PER_SM > 0: persistent, PER_SM programs
    per SM (`chunk_output` sizes the grid), each striding over the items, so that the loop's
    loads of the next item (q, k, Vn, h: 40-64 KB) are issued while this one computes: the
    config's num_stages is the depth of that software pipeline. Explicit where Triton would take
    one program per tile: the persistence and the pipeline, chosen by the autotuner against the
    one-shot form (at S1 the one-shot kernel ran at ~2 TB/s, 2 CTAs per SM, nothing to overlap).
    With BV = V (one of the tuned choices) q, k and Q K^T are loaded and formed once per chunk
    instead of once per V block. L2NORM_Q: q is the raw query and is normalised here, as stage 1
    would (rows of K in fp32, rounded to q's dtype): the forward's only use of the normalised q,
    so stage 1 for q and its round trip through HBM (2 bytes x 2 per element) are skipped."""
    NV: tl.constexpr = (V + BV - 1) // BV
    for item in tl.range(tl.program_id(0), NC * NV, tl.num_programs(0)):
        c, hh, bos, eos, r, tok, valid, row, kc, vc, mk, mv = _chunk_program(chunks_ptr, H, K, V, BK, BV, NV, BT, item)
        q = tl.load(q_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
        if L2NORM_Q:
            qf = q.to(tl.float32)
            q = _rounded_as(qf * tl.rsqrt(tl.sum(qf * qf, 1) + eps)[:, None], q_ptr, DA)
        q = _op(q, DT, DA)
        k = _op(tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0), DT, DA)
        G = tl.load(G_ptr + row, mask=valid, other=0.0)
        h = tl.load(h_ptr + (c.to(tl.int64) * H + hh) * (K * V) + kc[:, None] * V + vc[None, :],
                    mask=(kc < K)[:, None] & (vc < V)[None, :], other=0.0)
        vn = tl.load(vn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0)
        m = valid[:, None] & valid[None, :] & (r[:, None] >= r[None, :])
        gam = tl.exp(tl.where(m, (G[:, None] - G[None, :]).to(tl.float32), float("-inf")))
        P = tl.where(m, tl.dot(q, tl.trans(k), input_precision="ieee") * gam, 0.0)
        o = (tl.dot(q, _op(h, DT, DA), input_precision="ieee") * tl.exp(G.to(tl.float32))[:, None]
             + tl.dot(_op(P, DT, DA), _op(vn, DT, DA), input_precision="ieee"))
        tl.store(o_ptr + row[:, None] * V + vc[None, :], (o * scale).to(o_ptr.dtype.element_ty), mask=mv)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _dv_local_kernel(q_ptr, k_ptr, G_ptr, do_ptr, dvl_ptr, chunks_ptr, H, scale,
                     K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, BT: tl.constexpr,
                     DT: tl.constexpr, DA: tl.constexpr, PREC: tl.constexpr):
    """7: dVl = scale lower(Q K^T * Gam)^T dO (fp32), the part of dVn from this chunk's outputs."""
    c, hh, bos, eos, r, tok, valid, row, kc, vc, mk, mv = _chunk_program(chunks_ptr, H, K, V, BK, BV, NV, BT,
                                                                         tl.program_id(0))
    q = tl.load(q_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
    G = tl.load(G_ptr + row, mask=valid, other=0.0)
    do = tl.load(do_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
    mT = valid[:, None] & valid[None, :] & (r[:, None] <= r[None, :])  # [s, t], t >= s
    gamT = tl.exp(tl.where(mT, (G[None, :] - G[:, None]).to(tl.float32), float("-inf")))
    Pt = tl.where(mT, _mm(k, tl.trans(q), PREC, DT, DA) * gamT, 0.0)
    dvl = _mm(Pt, do, PREC, DT, DA) * scale
    tl.store(dvl_ptr + row[:, None] * V + vc[None, :], dvl, mask=mv)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.autotune(configs=_tuned(DSTATES_OPTIONS), key=["K", "V", "H", "NH_BUCKET", "PER_CHANNEL"])
@triton.jit
def _dstates_kernel(q_ptr, k_ptr, w_ptr, G_ptr, do_ptr, dvl_ptr, dht_ptr, dh_ptr, dvn_ptr, dh0_ptr,
                    cu_ptr, choff_ptr, H, NH_BUCKET, scale,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr,
                    PREC: tl.constexpr, PER_CHANNEL: tl.constexpr = False):
    """8: one program per (V block, sequence, head), chunks in reverse. dh [BK, BV] fp32 in
    registers is the gradient of the state leaving the chunk; it is stored, then
    dVn = dVl + diag(exp(G_L - G)) K dh (stored) and
    dh <- exp(G_L) dh + scale (diag(exp(G)) Q)^T dO - W^T dVn. At the end dh is d initial_state.
    PER_CHANNEL (KDA; G [Ntok, H, K]): dVn = dVl + (exp(G_L - G) * K) dh and
    dh <- diag(exp(G_L)) dh + scale (exp(G) * Q)^T dO - W^T dVn, as `_states_kernel` has it."""
    n, hh, bos, eos, c0, nc, r, kc, vc, smask, sblk = _sequence_program(cu_ptr, choff_ptr, H, K, V, BK, BV, BT)
    dh = _state_or_zeros(dht_ptr, n, hh, H, sblk, smask, K, V, BK, BV, HAS_DHT)
    for ii in range(0, nc):
        i = nc - 1 - ii
        # rounded to nearest where dh_ptr holds bf16 (`_rounded_for`: the interpreter's own cast truncates)
        tl.store(dh_ptr + ((c0 + i).to(tl.int64) * H + hh) * (K * V) + sblk,
                 _rounded_for(dh, dh_ptr, DA).to(dh_ptr.dtype.element_ty), mask=smask)
        tok = bos + i * BT + r
        valid = tok < eos
        row = tok.to(tl.int64) * H + hh
        mk = valid[:, None] & (kc < K)[None, :]
        mv = valid[:, None] & (vc < V)[None, :]
        last = tl.minimum(bos + i * BT + BT, eos) - 1
        k = tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
        if PER_CHANNEL:
            GL = tl.load(G_ptr + (last.to(tl.int64) * H + hh) * K + kc, mask=kc < K, other=0.0)
            G = tl.load(G_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
            kd = k * tl.exp(tl.where(mk, (GL[None, :] - G).to(tl.float32), float("-inf")))
            qg = q * scale * tl.exp(G.to(tl.float32))
            hdecay = tl.exp(GL.to(tl.float32))[:, None]
        else:
            GL = tl.load(G_ptr + last.to(tl.int64) * H + hh)
            G = tl.load(G_ptr + row, mask=valid, other=0.0)
            kd = k * tl.exp(tl.where(valid, (GL - G).to(tl.float32), float("-inf")))[:, None]
            qg = q * (scale * tl.exp(G.to(tl.float32)))[:, None]
            hdecay = tl.exp(GL.to(tl.float32))
        dvl = tl.load(dvl_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0)
        dvn = dvl + _mm(kd, dh, PREC, DT, DA)
        tl.store(dvn_ptr + row[:, None] * V + vc[None, :], _rounded_for(dvn, dvn_ptr, DA).to(dvn_ptr.dtype.element_ty),
                 mask=mv)
        w = tl.load(w_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        dh = (dh * hdecay
              + _mm(tl.trans(qg), do, PREC, DT, DA)
              - _mm(tl.trans(w), dvn, PREC, DT, DA))
    if STORE_DH0:
        tl.store(dh0_ptr + (n.to(tl.int64) * H + hh) * (K * V) + sblk, dh, mask=smask)


@triton.jit
def _d_prime_dG(D, qk, r):
    """dG's D' terms, rowsum(D' * QK^T) - colsum(D' * QK^T), D' = D off the diagonal: the diagonal
    of Gam has no gradient, its terms would enter dG twice with opposite signs and only leave
    rounding noise (which swamps dg when it is tiny, at very negative gates)."""
    M = tl.where(r[:, None] > r[None, :], D * qk, 0.0)
    return tl.sum(M, 1) - tl.sum(M, 0)


@triton.jit
def _gated_lower_pair(ds, dsT, G, r, valid, scale):
    """D = lower(scale dS * Gam) and D^T = upper(scale dS^T * Gam^T), each from its own
    accumulator (D^T never by tl.trans of D: see 9), Gam_ts = exp(G_t - G_s) on valid rows."""
    m = valid[:, None] & valid[None, :] & (r[:, None] >= r[None, :])
    gam = tl.exp(tl.where(m, (G[:, None] - G[None, :]).to(tl.float32), float("-inf")))
    mT = valid[:, None] & valid[None, :] & (r[:, None] <= r[None, :])
    gamT = tl.exp(tl.where(mT, (G[None, :] - G[:, None]).to(tl.float32), float("-inf")))
    return tl.where(m, ds * gam * scale, 0.0), tl.where(mT, dsT * gamT * scale, 0.0)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _dqk_local_kernel(q_ptr, k_ptr, G_ptr, vn_ptr, do_ptr, dql_ptr, dkl_ptr, dG_ptr, chunks_ptr, H, scale,
                      K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                      BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, PREC: tl.constexpr):
    """9a (DQKWG_FORM "split"): the chunk-local part of 9, once per chunk and head (grid (NC, H)):
        dS = dO Vn^T, dS^T = Vn dO^T (over V), D = lower(scale dS * Gam),
        dql = D K, dkl = D^T Q (fp32, in blocks of BKS key columns), and dG's D' terms
        rowsum(D' * QK^T) - colsum(D' * QK^T) (D' = D off the diagonal) as one partial of dG.
    Why apart: in the one-kernel form every block of key columns formed dS, dS^T and Q K^T again
    and held five accumulators (sm_90a: 800 B of spills per thread, 3.3 ms at S1 on the H200);
    here they are formed once, and 9b (`_dqkwg_kernel` with DS_HERE False) keeps three."""
    NK: tl.constexpr = (K + BKS - 1) // BKS
    c, hh, bos, eos, r, tok, valid, row, _, _, _, _ = _chunk_program(chunks_ptr, H, K, V, BKS, BV, 1, BT,
                                                                     tl.program_id(0))
    ds = tl.full([BT, BT], 0.0, tl.float32)
    dsT = tl.full([BT, BT], 0.0, tl.float32)
    for j in tl.static_range(NV):
        vc = j * BV + tl.arange(0, BV)
        mv = valid[:, None] & (vc < V)[None, :]
        vn = tl.load(vn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        ds += _mm(do, tl.trans(vn), PREC, DT, DA)
        dsT += _mm(vn, tl.trans(do), PREC, DT, DA)
    G = tl.load(G_ptr + row, mask=valid, other=0.0)
    D, Dt = _gated_lower_pair(ds, dsT, G, r, valid, scale)
    qk = tl.full([BT, BT], 0.0, tl.float32)
    for kk in tl.static_range(NK):
        kc = kk * BKS + tl.arange(0, BKS)
        mk = valid[:, None] & (kc < K)[None, :]
        q = tl.load(q_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
        tl.store(dql_ptr + row[:, None] * K + kc[None, :], _mm(D, k, PREC, DT, DA), mask=mk)
        tl.store(dkl_ptr + row[:, None] * K + kc[None, :], _mm(Dt, q, PREC, DT, DA), mask=mk)
        qk += _mm(q, tl.trans(k), PREC, DT, DA)
    tl.store(dG_ptr + row, _d_prime_dG(D, qk, r), mask=valid)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _dqkwg_kernel(q_ptr, k_ptr, G_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, dql_ptr, dkl_ptr,
                  dq_ptr, dk_ptr, dw_ptr, dG_ptr, chunks_ptr, H, scale, dG_stride,
                  K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                  BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, PREC: tl.constexpr, DS_HERE: tl.constexpr):
    """9: per chunk, head and block of BKS key columns (grid (NC * NK, H)), summing over V blocks:
        dQa = dO h_c^T,  dS = dO Vn^T,  dKs = Vn dh^T,  dW = -dVn h_c^T,  dgl = sum(h_c * dh)
    (dh: the gradient of the state leaving the chunk); then, with D = lower(scale dS * Gam):
        dQ = scale diag(exp(G)) dQa + D K                                   (final, or fp32 for l2norm)
        dK = D^T Q + diag(exp(G_L - G)) dKs                                 (fp32; 10 adds the rest)
    D^T is built from its own accumulator dS^T = Vn dO^T, never by tl.trans of a dot result: that
    pattern (FLA's `tl.dot(tl.trans(b_ds), b_q)`) is what triton 3.4-3.7.0 miscompiles on Hopper
    (fla-org/flash-linear-attention issue 640).
        dG = scale exp(G) rowsum(Q * dQa) + rowsum(D' * QK^T) - colsum(D' * QK^T) - x,
             x = exp(G_L - G) rowsum(K * dKs) (0 on the last valid row), D' = D off the diagonal;
             the last valid row also gets exp(G_L) dgl + sum(x).
    Split over key columns by hand (BKS = 64 of K = 128): the five accumulators of a whole-K
    program spilled 2.2 KB per thread on sm_90a (ptxas, 2026-11-29), and the H200 profile had this
    kernel at 4.2 ms of the 13 ms forward+backward. dS, dS^T and Q K^T (all K) are formed again by
    every column block; each block writes its dQ, dK, dW columns and its own partial of dG (every
    term of dG is a sum over key columns, the D' terms taken by block 0 alone), and 10 adds the
    partials. DS_HERE False (DQKWG_FORM "split"): D K, D^T Q and the D' terms of dG come from
    `_dqk_local_kernel` instead (dql, dkl, its own partial of dG), and this kernel keeps the three
    state accumulators dQa, dKs, dW."""
    NK: tl.constexpr = (K + BKS - 1) // BKS
    kb = tl.program_id(0) % NK
    c, hh, bos, eos, r, tok, valid, row, _, _, _, _ = _chunk_program(chunks_ptr, H, K, V, BKS, BV, 1, BT,
                                                                     tl.program_id(0) // NK)
    kc = kb * BKS + tl.arange(0, BKS)
    mk = valid[:, None] & (kc < K)[None, :]
    sbase = (c.to(tl.int64) * H + hh) * (K * V)
    dqa = tl.full([BT, BKS], 0.0, tl.float32)
    dks = tl.full([BT, BKS], 0.0, tl.float32)
    dw = tl.full([BT, BKS], 0.0, tl.float32)
    ds = tl.full([BT, BT], 0.0, tl.float32)
    dsT = tl.full([BT, BT], 0.0, tl.float32)
    hdh = 0.0  # sum(h_c * dh) over this block's rows of the state: a scalar, not a tile
    for j in tl.static_range(NV):
        vc = j * BV + tl.arange(0, BV)
        mv = valid[:, None] & (vc < V)[None, :]
        smask = (kc < K)[:, None] & (vc < V)[None, :]
        h = tl.load(h_ptr + sbase + kc[:, None] * V + vc[None, :], mask=smask, other=0.0)
        dh = tl.load(dh_ptr + sbase + kc[:, None] * V + vc[None, :], mask=smask, other=0.0)
        vn = tl.load(vn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        dvn = tl.load(dvn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        ht = tl.trans(h)
        # every product here goes through `_mm`: dG reads dQa, dS (through D' * QK^T), dKs and
        # (in 10) dW; the rest feed dQ and dK only, but leaving them on rounded operands kept a
        # rounded copy of each tile live beside the fp32 one (sm_90a ptxas: 868 B of spills
        # against 644 B with all of them through `_mm`)
        dqa += _mm(do, ht, PREC, DT, DA)
        if DS_HERE:
            ds += _mm(do, tl.trans(vn), PREC, DT, DA)
            dsT += _mm(vn, tl.trans(do), PREC, DT, DA)
        dks += _mm(vn, tl.trans(dh), PREC, DT, DA)
        dw -= _mm(dvn, ht, PREC, DT, DA)
        hdh += tl.sum(h * dh)
    q = tl.load(q_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
    G = tl.load(G_ptr + row, mask=valid, other=0.0)
    last = tl.minimum(bos + BT, eos) - 1
    GL = tl.load(G_ptr + last.to(tl.int64) * H + hh)
    eg = tl.exp(G.to(tl.float32))
    decay = tl.exp(tl.where(valid, (GL - G).to(tl.float32), float("-inf")))
    if DS_HERE:
        D, Dt = _gated_lower_pair(ds, dsT, G, r, valid, scale)
        dq = dqa * (scale * eg)[:, None] + _mm(D, k, PREC, DT, DA)
        dk = _mm(Dt, q, PREC, DT, DA) + dks * decay[:, None]
    else:
        dq = dqa * (scale * eg)[:, None] + tl.load(dql_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
        dk = dks * decay[:, None] + tl.load(dkl_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
    # exp(G_L - G_last) = 1 has no gradient: the last row's x is left out, not cancelled (as the
    # diagonal of Gam in `_d_prime_dG`)
    x = tl.where(tok == last, 0.0, decay * tl.sum(k * dks, 1))
    dG = scale * eg * tl.sum(q * dqa, 1) - x
    dG += tl.where(tok == last, tl.exp(GL.to(tl.float32)) * hdh + tl.sum(x, 0), 0.0)
    if DS_HERE:
        if kb == 0:
            # the D' terms (`_d_prime_dG`), Q K^T over all of K one BKS block at a time
            qk = tl.full([BT, BT], 0.0, tl.float32)
            for kk in tl.static_range(NK):
                kcc = kk * BKS + tl.arange(0, BKS)
                mkk = valid[:, None] & (kcc < K)[None, :]
                qb = tl.load(q_ptr + row[:, None] * K + kcc[None, :], mask=mkk, other=0.0).to(tl.float32)
                kbk = tl.load(k_ptr + row[:, None] * K + kcc[None, :], mask=mkk, other=0.0).to(tl.float32)
                qk += _mm(qb, tl.trans(kbk), PREC, DT, DA)
            dG += _d_prime_dG(D, qk, r)
    tl.store(dq_ptr + row[:, None] * K + kc[None, :], dq.to(dq_ptr.dtype.element_ty), mask=mk)
    tl.store(dk_ptr + row[:, None] * K + kc[None, :], dk, mask=mk)
    tl.store(dw_ptr + row[:, None] * K + kc[None, :], dw, mask=mk)
    tl.store(dG_ptr + kb * dG_stride + row, dG, mask=valid)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _wy_bwd_kernel(k_ptr, v_ptr, beta_ptr, G_ptr, Ai_ptr, w_ptr, u_ptr, dw_ptr, dvn_ptr, dkp_ptr, dGp_ptr,
                   dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, da_ptr, dat_ptr, vdu_ptr, chunks_ptr, H, dGp_stride,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                   BT: tl.constexpr, DT: tl.constexpr, DA: tl.constexpr, PREC: tl.constexpr, NKP: tl.constexpr,
                   BKW: tl.constexpr, PHASE: tl.constexpr):
    """10: back through W, U, T and A. With dU = dVn and dW from 9:  dU' = T^T dU,  dW' = T^T dW,
        dA = strict_lower(-(dU' U^T + dW' W^T))      (T = (I + A)^-1)
        dV = diag(beta) dU'
        dbeta = rowsum(V * dU') + exp(G) rowsum(K * dW') + rowsum(dA * Gam * KK^T)
        dK += diag(beta exp(G)) dW' + B K + B^T K,   B = diag(beta) (dA * Gam)
        dG += beta exp(G) rowsum(K * dW') + rowsum(B * KK^T) - colsum(B * KK^T)
    and dg = the reverse cumulative sum of dG inside the chunk (dG starts as the sum of 9's NKP
    partials, one per block of K). B^T comes from its own product
    dA^T = strict_upper(-(W dW'^T + U dU'^T)), with dW'^T = dW^T T and dU'^T = dU^T T formed from
    loaded tiles: no tl.trans of a dot result feeds a dot (see 9). Grid (NC, H).

    Explicit where Triton would choose: the key columns go in blocks of BKW (every K-side term is
    a sum over key columns, dW' and dK are column-local), so at most a [64, BKW] tile of W, dW,
    dW', K or dK is live at once: with fp32 operands (BACKWARD_PRODUCTS) a whole [64, 128] fp32
    tile per operand is what made this kernel spill. BKW = BK is one block: the products of the
    kernel before the sixth session, though not its code (ptxas: 1876 B of spills per thread at
    tf32 against that kernel's 1624 B).

    PHASE: "all" (the above in one program), or the two halves of WY_BWD_FORM "split": "da" (dA,
    dA^T and rowsum(V * dU') stored to da, dat, vdu; dV stored) and "apply" (the rest, from them):
    each half holds fewer [64, 64] fp32 tiles at once than the whole (sm_90a: 1044 B of spills per
    thread for "all" at K = V = 128, 8 warps, tf32 products)."""
    c, hh, bos, eos, r, tok, valid, row, _, _, _, _ = _chunk_program(chunks_ptr, H, K, V, BK, BV, 1, BT,
                                                                     tl.program_id(0))
    NKW: tl.constexpr = BK // BKW
    Tm = tl.load(Ai_ptr + row[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0)
    Tt = tl.trans(Tm)
    Tr = _op(Tm, DT, DA)
    beta = tl.load(beta_ptr + row, mask=valid, other=0.0).to(tl.float32)
    # dbeta and dG read dA, dU' (rowsum(V * dU')), dW' and K K^T: those products go through
    # `_mm`; dA^T, dU'^T and dK's two products feed dK alone and stay plain products of
    # rounded operands
    # (dA, dA^T, rowsum(V * dU')): formed here, or by the "da" launch before this "apply" one
    if PHASE == "apply":
        dA = tl.load(da_ptr + row[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0)
        dAt = tl.load(dat_ptr + row[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0)
        vdu = tl.load(vdu_ptr + row, mask=valid, other=0.0)
    else:
        dA, dAt, vdu = _wy_bwd_da(Tt, Tr, beta, w_ptr, dw_ptr, dvn_ptr, v_ptr, u_ptr, dv_ptr, row, valid, K, V, BV, NV,
                                  BKW, NKW, DT, DA, PREC)
    if PHASE == "da":
        tl.store(da_ptr + row[:, None] * BT + r[None, :], dA, mask=valid[:, None])
        tl.store(dat_ptr + row[:, None] * BT + r[None, :], dAt, mask=valid[:, None])
        tl.store(vdu_ptr + row, vdu, mask=valid)
    else:
        _wy_bwd_apply(dA, dAt, vdu, Tt, beta, k_ptr, G_ptr, dw_ptr, dkp_ptr, dGp_ptr, dk_ptr, dbeta_ptr, dg_ptr, row, r,
                      tok, valid, dGp_stride, K, BKW, NKW, NKP, DT, DA, PREC)


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _wy_bwd_da(Tt, Tr, beta, w_ptr, dw_ptr, dvn_ptr, v_ptr, u_ptr, dv_ptr, row, valid, K: tl.constexpr,
               V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, BKW: tl.constexpr, NKW: tl.constexpr,
               DT: tl.constexpr, DA: tl.constexpr, PREC: tl.constexpr):
    """10's first half: (dA, dA^T, rowsum(V * dU')) of one chunk and head, dV stored."""
    BT: tl.constexpr = Tt.shape[0]
    dA = tl.full([BT, BT], 0.0, tl.float32)
    dAt = tl.full([BT, BT], 0.0, tl.float32)
    for kb in tl.static_range(NKW):
        kc = kb * BKW + tl.arange(0, BKW)
        mk = valid[:, None] & (kc < K)[None, :]
        w = tl.load(w_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
        dw = tl.load(dw_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
        dA -= _mm(_mm(Tt, dw, PREC, DT, DA), tl.trans(w), PREC, DT, DA)
        dAt -= tl.dot(_op(w, DT, DA), _op(tl.dot(tl.trans(_op(dw, DT, DA)), Tr, input_precision="ieee"), DT, DA),
                      input_precision="ieee")
    vdu = tl.full([BT], 0.0, tl.float32)  # rowsum(V * dU'), accumulated as a vector (not a [BT, BV] tile)
    for j in tl.static_range(NV):
        vc = j * BV + tl.arange(0, BV)
        mv = valid[:, None] & (vc < V)[None, :]
        dvn = tl.load(dvn_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0)
        dup = _mm(Tt, dvn, PREC, DT, DA)
        dupT = tl.dot(tl.trans(_op(dvn, DT, DA)), Tr, input_precision="ieee")
        tl.store(dv_ptr + row[:, None] * V + vc[None, :], (dup * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mv)
        v = tl.load(v_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0).to(tl.float32)
        vdu += tl.sum(v * dup, 1)
        u = tl.load(u_ptr + row[:, None] * V + vc[None, :], mask=mv, other=0.0)
        dA -= _mm(dup, tl.trans(u), PREC, DT, DA)
        dAt -= tl.dot(_op(u, DT, DA), _op(dupT, DT, DA), input_precision="ieee")
    return dA, dAt, vdu


# lint: allow-function TP001,TP007 -- [64, K] chunk tiles of [T, H, K] tensors: a TMA port belongs to the Gluon backend (issue 5), and varlen tails would need a descriptor per sequence; constexpr strides already give 16-byte vector accesses (checked in the sm_90a PTX)
@triton.jit
def _wy_bwd_apply(dA, dAt, vdu, Tt, beta, k_ptr, G_ptr, dw_ptr, dkp_ptr, dGp_ptr, dk_ptr, dbeta_ptr, dg_ptr, row, r, tok,
                  valid, dGp_stride, K: tl.constexpr, BKW: tl.constexpr, NKW: tl.constexpr, NKP: tl.constexpr,
                  DT: tl.constexpr, DA: tl.constexpr, PREC: tl.constexpr):
    """10's second half, from (dA, dA^T, rowsum(V * dU')): dK, dbeta and dg stored."""
    BT: tl.constexpr = Tt.shape[0]
    G = tl.load(G_ptr + row, mask=valid, other=0.0)
    eg = tl.exp(G.to(tl.float32))
    m = valid[:, None] & valid[None, :] & (r[:, None] > r[None, :])
    gam = tl.exp(tl.where(m, (G[:, None] - G[None, :]).to(tl.float32), float("-inf")))
    dAg = tl.where(m, dA * gam, 0.0)
    B = dAg * beta[:, None]
    mT = valid[:, None] & valid[None, :] & (r[:, None] < r[None, :])
    gamT = tl.exp(tl.where(mT, (G[None, :] - G[:, None]).to(tl.float32), float("-inf")))
    Bt = tl.where(mT, dAt * gamT, 0.0) * beta[None, :]  # = B^T
    Bop = _op(B, DT, DA)
    Btop = _op(Bt, DT, DA)
    kk = tl.full([BT, BT], 0.0, tl.float32)
    kdw = tl.full([BT], 0.0, tl.float32)
    for kb in tl.static_range(NKW):
        kc = kb * BKW + tl.arange(0, BKW)
        mk = valid[:, None] & (kc < K)[None, :]
        k = tl.load(k_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0).to(tl.float32)
        kk += _mm(k, tl.trans(k), PREC, DT, DA)
        # dW' = T^T dW again, from a reload, rather than held through the V loop: a [64, K] fp32
        # tile live across it spilled (ptxas, sm_90a); the second dot is cheap next to the spills
        dw = tl.load(dw_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0)
        dwp = _mm(Tt, dw, PREC, DT, DA)
        kdw += tl.sum(k * dwp, 1)
        kd = _op(k, DT, DA)
        dk = (tl.load(dkp_ptr + row[:, None] * K + kc[None, :], mask=mk, other=0.0) + dwp * (beta * eg)[:, None]
              + tl.dot(Bop, kd, input_precision="ieee") + tl.dot(Btop, kd, input_precision="ieee"))
        tl.store(dk_ptr + row[:, None] * K + kc[None, :], dk.to(dk_ptr.dtype.element_ty), mask=mk)
    dbeta = vdu + eg * kdw + tl.sum(dAg * kk, 1)
    M = B * kk
    dG = beta * eg * kdw + tl.sum(M, 1) - tl.sum(M, 0)
    for kb in tl.static_range(NKP):
        dG += tl.load(dGp_ptr + kb * dGp_stride + row, mask=valid, other=0.0)
    dg = tl.cumsum(dG, 0, reverse=True)
    tl.store(dbeta_ptr + row, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)
    tl.store(dg_ptr + row, dg.to(dg_ptr.dtype.element_ty), mask=valid)


# ----------------------------------------------------------------------------------------
# stage functions (host): one kernel launch each
# ----------------------------------------------------------------------------------------

_F32 = torch.float32

# Launch settings of the chunk-parallel backward kernels (dstates is autotuned, see `_tuned`).
# dqkwg and wy_bwd: 8 warps spill least on sm_90a (280 and 472 B at K = V = 128; 4 warps: 1400
# and 1736 B).
# wy_bwd's block of key columns (`_wy_bwd_kernel`'s BKW; a power of two, >= 16): 64, or >= BK for
# the whole [64, K] tiles in one block (sm_90a spills per thread at K = V = 128, 8 warps, tf32
# products: docs/perf/gdn.md log row 17).
WY_BWD_KEY_BLOCK = 64
# dqkwg's block of key columns (BKS, `_key_split`; a power of two, >= 16): 64 (two blocks at K =
# 128) or 32 (four: dQa, dKs, dW shrink to [64, 32], dS and dS^T are formed by twice as many
# programs). sm_90a at K = V = 128, tf32 products on fp32 operands, 8 warps: spills per thread
# 604 B at 64, 76 B at 32 (BV = 32: 56 B; 4 warps: 132 B). Off until timed (log row 23).
DQKWG_KEY_BLOCK = 64
_LAUNCH = {
    "dv_local": dict(num_warps=4),
    "dqkwg": dict(num_warps=8),
    "wy_bwd": dict(num_warps=8),
}


def _out(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The buffer a kernel writes an output of `dtype` into. Under the interpreter a bf16 output is
    written as fp32 and rounded by torch in `_done`: the interpreter's fp32 -> bf16 store truncates,
    where the GPU's rounds to nearest even, and truncation would bias every bf16 result."""
    if dtype == torch.bfloat16 and interpreter_enabled():
        return new_empty(shape, _F32, device)
    return new_empty(shape, dtype, device)


def _done(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return buf if buf.dtype == dtype else buf.to(dtype)


def _l2norm_rows(D: int) -> tuple[int, int]:
    BD = max(16, next_pow2(D))
    return BD, max(16, 4096 // BD)


def l2norm_fwd(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """1: x * rsqrt(sum(x^2) + 1e-6) over the last dim, in out_dtype (default: x's dtype)."""
    D = x.shape[-1]
    out_dtype = out_dtype or x.dtype
    y = _out(x.shape, out_dtype, x.device)
    n_rows = x.numel() // D
    BD, BR = _l2norm_rows(D)
    if n_rows:
        _l2norm_fwd_kernel[(cdiv(n_rows, BR),)](x, y, n_rows, L2NORM_EPS, D, BD, BR)
    return _done(y, out_dtype)


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """11: the gradient through l2norm_fwd, from x and dy (fp32)."""
    D = x.shape[-1]
    dx = _out(x.shape, out_dtype, x.device)
    n_rows = x.numel() // D
    BD, BR = _l2norm_rows(D)
    if n_rows:
        _l2norm_bwd_kernel[(cdiv(n_rows, BR),)](x, dy, dx, n_rows, L2NORM_EPS, D, BD, BR)
    return _done(dx, out_dtype)


def chunk_cumsum(g: torch.Tensor, plan: ChunkPlan, out_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """2: G [Ntok, H] fp64 (GDN), or [Ntok, H, K] for per-channel gates g [Ntok, H, K] (KDA). The sums
    are fp64 in the kernel either way; out_dtype fp32 (KDA's GATE_SUMS for 16-bit inputs) rounds
    each once as it is stored."""
    per_channel = g.dim() == 3
    Ntok, H = g.shape[:2]
    K = g.shape[2] if per_channel else 1
    if out_dtype not in (torch.float64, torch.float32) or (out_dtype == torch.float32 and not per_channel):
        raise ValueError(f"chunk_cumsum: G in float64, or float32 for per-channel gates; got {out_dtype}")
    G = new_empty(tuple(g.shape), out_dtype, g.device)
    if plan.NC:
        _cumsum_kernel[(plan.NC, H)](g, G, plan.chunks, H, BT, per_channel, K, _blocks(K, 1)[0])
    return G


def _intermediate_dtype(dtype: torch.dtype, compact: bool) -> torch.dtype:
    """Storage of W, U, h and Vn between kernels: bf16 for 16-bit inputs when `compact` (the
    forward: halves the bytes of the states and output kernels; every matmul already rounds these
    operands to bf16, so what is lost is only the rounding of U - W h before its own rounding),
    fp32 otherwise (fp32 inputs, and the backward's recompute, whose gradient kernels add to them)."""
    return torch.bfloat16 if compact and dtype != torch.float32 else _F32


def chunk_solve_wu(k, v, beta, G, plan: ChunkPlan, store_T: bool = False, compact: bool = False,
                   exact_wu: bool = False, keys_normalised: bool = False, l2norm_k: bool = False,
                   factored_diagonal: bool = False, input_dtype: torch.dtype | None = None,
                   kn_out: torch.Tensor | None = None, g: torch.Tensor | None = None,
                   span_flags: torch.Tensor | None = None, with_wu: bool = True,
                   t_dtype: torch.dtype = torch.float32, worklist_out: torch.Tensor | None = None):
    """3: (T or None, W, U): T = (I + A)^-1 per chunk as [Ntok, H, 64] fp32 (row t of its chunk's
    T) when store_T (t_dtype: the op's 16-bit dtype instead, for T alone that no backward reads:
    KDA's forward whose fused kernel rounds T to that dtype as it reads it); W [Ntok, H, K],
    U [Ntok, H, V] in `_intermediate_dtype`. Without with_wu
    (KDA's forward that forms Vn from T, with span_flags and store_T): T alone (both kernels'
    WITH_WU off), W and U None. G [Ntok, H, K] (from
    per-channel gates) selects the KDA form of A and W. l2norm_k: k is raw and the kernel
    normalises it (the tile form only, or the per-channel one with span_flags and kn_out, flagged
    chunks' keys included; keys_normalised is then implied). factored_diagonal (KDA):
    the kernel's FACTORED_DIAGONAL. input_dtype: the op's input dtype where k is not in it (the
    backward's fp32 normalised keys), which picks the form, the rounding and the precision.
    kn_out (with l2norm_k): where the kernel also stores the normalised keys, k's shape and dtype.
    g (the tile form): the raw gates, [Ntok, H] (scalar) or [Ntok, H, K] (with span_flags); G is
    then an output, the kernel forms the in-chunk sums (stage 2) and stores them there. span_flags (KDA's forward or its
    backward's recompute, 16-bit inputs; int8 [NC, H]): the per-channel tile form (`_solve_wu_tile_kernel` with PER_CHANNEL,
    whole-chunk factors) where a chunk's gates allow it, flagged there otherwise, and the block
    kernel for the flagged chunks only; the flags are left for the output kernel. KDA's forward
    with store_T and not exact_wu keeps T (fp32, at the forward's precisions) for its backward.
    worklist_out (with span_flags): int32 [1 + NC * H], where the flagged chunks' worklist
    (`flagged_worklist`) is formed once the flags are, for the caller's other flagged launches."""
    if worklist_out is not None and span_flags is None:
        raise ValueError("worklist_out needs span_flags: the worklist is of the flagged chunks")
    Ntok, H, K = k.shape
    V = v.shape[-1]
    BK, BV, NV = _blocks(K, V)
    dtype = input_dtype or k.dtype
    if not with_wu and not (store_T and span_flags is not None):
        raise ValueError("with_wu=False (T alone) needs span_flags and store_T: the per-channel tile form keeping T")
    if t_dtype != _F32 and (with_wu or t_dtype != dtype):
        raise ValueError(f"t_dtype {t_dtype}: T is fp32, or in the 16-bit input dtype ({dtype}) for T alone "
                         "(with_wu=False)")
    inter = _intermediate_dtype(dtype, compact)
    Ai = new_empty((Ntok, H, BT), t_dtype, k.device) if store_T else None
    # T alone (with_wu False): no W and U (the kernels' w and u pointers are then T's, untouched)
    w = new_empty((Ntok, H, K), inter, k.device) if with_wu else None
    u = new_empty((Ntok, H, V), inter, k.device) if with_wu else None
    if not plan.NC:
        return Ai, w, u
    DT, DA = _dot_types(dtype)
    form = solve_form(dtype, G.dim() == 3)
    if l2norm_k and form != "tile" and span_flags is None:
        raise ValueError("l2norm_k needs the tile form of stage 3 (16-bit inputs, SOLVE_FORM = 'tile')")
    if kn_out is not None and not (l2norm_k and kn_out.shape == k.shape and kn_out.dtype == k.dtype):
        raise ValueError("kn_out needs l2norm_k and k's shape and dtype")
    if g is not None and not ((form == "tile" or span_flags is not None) and g.shape == G.shape
                              and (G.dtype == torch.float64 or (span_flags is not None and G.dtype == torch.float32))):
        raise ValueError("g needs the tile form of stage 3 (or span_flags) and G as its output (fp64; fp32 with "
                         "span_flags), g's shape")
    if span_flags is not None:
        if G.dim() != 3 or dtype == torch.float32 or (exact_wu and not store_T) or l2norm_k != (kn_out is not None):
            raise ValueError("span_flags: the per-channel tile form is for 16-bit inputs, in the forward (which may "
                             "keep T for its backward: store_T) or the backward's recompute (store_T with exact_wu); "
                             "keys it normalises (l2norm_k) it stores (kn_out)")
        if span_flags.shape != (plan.NC, H) or span_flags.dtype != torch.int8:
            raise ValueError(f"span_flags must be int8 [{plan.NC}, {H}], got {span_flags.dtype} {tuple(span_flags.shape)}")
        prec, diag_prec = _tile_precisions(dtype, compact, store_T, exact_wu, keys_normalised or l2norm_k)
        Ai_or_w = Ai if store_T else w
        _solve_wu_tile_kernel[(plan.NC, H)](k, v, beta, G, Ai_or_w, w if with_wu else Ai, u if with_wu else Ai, plan.chunks,
                                            H, K, V, *_tile_blocks(K, V), BT, DT, DA,
                                            prec, store_T, exact_wu, L2NORM_EPS, L2NORM_K=l2norm_k, WITH_WU=with_wu,
                                            kn_ptr=kn_out, STORE_KN=l2norm_k, g_ptr=g, CUMSUM_G=g is not None,
                                            T_CHAIN=_t_chain(), DIAG_PREC=diag_prec, PER_CHANNEL=True,
                                            flags_ptr=span_flags)
        # the flagged chunks' keys: stored normalised by the tile kernel where it normalised them
        solve_flagged_chunks(kn_out if l2norm_k else k, v, beta, G, Ai_or_w, w, u, plan, dtype, store_T, exact_wu,
                             factored_diagonal, span_flags, flagged_worklist(span_flags, out=worklist_out))
        return Ai, w, u
    if form == "tile":
        prec, diag_prec = _tile_precisions(dtype, compact, store_T, exact_wu, keys_normalised or l2norm_k)
        if WU_FORM == "split" and inter != _F32 and not (store_T or exact_wu or l2norm_k or g is not None):
            # 3a: T alone, in bf16 as W and U's products read it; 3b: W and U in column blocks
            Tb = new_empty((Ntok, H, BT), inter, k.device)
            _solve_wu_tile_kernel[(plan.NC, H)](k, v, beta, G, Tb, w, u, plan.chunks, H, K, V, *_tile_blocks(K, V), BT, DT, DA,
                                                prec, True, False, L2NORM_EPS, False, False, T_CHAIN=_t_chain(),
                                                DIAG_PREC=diag_prec)
            for x, out, gated in ((k, w, True), (v, u, False)):
                D = x.shape[-1]
                BC = min(64, max(16, next_pow2(D)))
                _wu_from_t_kernel[(plan.NC * cdiv(D, BC), H)](Tb, x, beta, G, out, plan.chunks, H, D, BC, cdiv(D, BC),
                                                              BT, DT, DA, gated, **WU_FROM_T_LAUNCH)
            return Ai, w, u
        _solve_wu_tile_kernel[(plan.NC, H)](k, v, beta, G, Ai if store_T else w, w, u, plan.chunks, H, K, V,
                                            *_tile_blocks(K, V), BT, DT, DA, prec, store_T, exact_wu, L2NORM_EPS, l2norm_k, True,
                                            kn_out, kn_out is not None, g, g is not None, _t_chain(), diag_prec)
    else:
        _solve_wu_kernel[(plan.NC, H)](k, v, beta, G, Ai if store_T else w, w, u, plan.chunks, H, K, V, BK, BV, NV, BT,
                                       DT, DA, G.dim() == 3, store_T, exact_wu, factored_diagonal and G.dim() == 3)
    return Ai, w, u


def solve_flagged_chunks(k, v, beta, G, Ai_or_w, w, u, plan: ChunkPlan, input_dtype: torch.dtype, store_T: bool,
                         exact_wu: bool, factored_diagonal: bool, span_flags: torch.Tensor,
                         worklist: torch.Tensor | None = None):
    """3 for the chunks a whole-chunk stage-3 kernel flagged (KDA, span_flags int8 [NC, H]):
    `_solve_wu_kernel` with ONLY_FLAGGED on their worklist, in 16-row blocks, into the same T (Ai_or_w, when
    store_T), W and U (T alone where w and u are None); input_dtype: the op's (which sets the
    products' rounding). worklist: `flagged_worklist(span_flags)` where the caller formed it."""
    H, K = k.shape[1], k.shape[2]
    V = v.shape[-1]
    BK, BV, NV = _blocks(K, V)
    DT, DA = _dot_types(input_dtype)
    with_wu = w is not None
    grid = (worklist_programs(k.device, plan.NC * H),)
    _solve_wu_kernel[grid](k, v, beta, G, Ai_or_w, w if with_wu else Ai_or_w, u if with_wu else Ai_or_w,
                           plan.chunks, H, K, V, BK, BV, NV, BT, DT, DA, True, store_T, exact_wu,
                           factored_diagonal, ONLY_FLAGGED=True, WITH_WU=with_wu,
                           flags_ptr=worklist if worklist is not None else flagged_worklist(span_flags))


def _tile_precisions(dtype: torch.dtype, compact: bool, store_T: bool, exact_wu: bool, keys_normalised: bool):
    """(PREC, DIAG_PREC) of `_solve_wu_tile_kernel` for a call: the [64, 64] products and the
    diagonal blocks' inverses, exact-ish but with normalised 16-bit keys, where the forward and the
    backward's recompute each have their switches."""
    prec, diag_prec = ("ieee" if dtype == torch.float32 else "tf32x3"), "ieee"
    if dtype != torch.float32 and keys_normalised:
        if compact and not exact_wu:  # the forward (KDA's may also store T for its backward)
            prec = _checked("NORMALISED_KEYS_PREC", NORMALISED_KEYS_PREC, ("tf32x3", "tf32", "bf16"))
            diag_prec = _checked("NORMALISED_KEYS_DIAG_PREC", NORMALISED_KEYS_DIAG_PREC, ("ieee", "tf32"))
        elif store_T and exact_wu:  # the backward's recompute
            prec = _checked("RECOMPUTE_NORMALISED_KEYS_PREC", RECOMPUTE_NORMALISED_KEYS_PREC, ("tf32x3", "tf32"))
            diag_prec = _checked("RECOMPUTE_NORMALISED_KEYS_DIAG_PREC", RECOMPUTE_NORMALISED_KEYS_DIAG_PREC,
                                 ("ieee", "tf32"))
    return _emulated_here(prec), _emulated_here(diag_prec)


# Which kernel forms T, W and U: "blocks" (`_solve_wu_kernel`, a chain of 16x16 blocks; KDA's
# per-channel gates and fp32 inputs always take it) or "tile" (`_solve_wu_tile_kernel`, whole
# [64, 64] tiles). Read at each call, so a benchmark can set it to compare the two. "tile" since
# the H200 A/B at 31eb250 (scripts/gdn_ab.py, S1): forward 0.601 ms against 1.358, the backward's
# recompute 1.451 against 2.239, W and U within 1e-7 of the block form; the 16-bit frozen gate
# passed in this form there (tests/test_gdn_tuning.py::test_tile_solve_form).
SOLVE_FORM = "tile"

# The forward's tile form in one kernel ("fused": T, W and U per chunk in one serial chain) or two
# ("split": `_solve_wu_tile_kernel` with WITH_WU = False stores T in bf16, 8 KB per chunk-head,
# then `_wu_from_t_kernel` forms W and U in [64, 64] column blocks, NC * (K + V) / 64 independent
# programs). Same values (the same roundings). Only for keys already normalised (not with
# L2NORM_K_FORM "in-kernel" or "stage-3", where the fused kernel runs). Off: no faster on the H200
# (log row 18, gdn_ab.py at aeda491: whole forward at S1 1.051 ms against fused 1.047 at tf32,
# 1.014 against 1.001 at bf16; ncu: the T-only kernel 56% of the fused one, the two W/U kernels at
# ~72% of DRAM bandwidth add the rest back).
WU_FORM = "fused"
WU_FROM_T_LAUNCH = dict(num_warps=4, num_stages=1)


# The tile form's [64, 64] fp32 products in the forward when the keys are l2-normalised (so
# |A_ij| = beta_i |k_i . k_j| exp(G_i - G_j) <= 1) and W, U are stored in bf16: "tf32x3" (three
# tf32 passes), "tf32" (one; the default) or "bf16" (one, operands rounded to bf16). scripts/gdn_ab.py at 31eb250 (S1, normalised keys):
# W from one-pass tf32 within 4e-8 (normwise) of the exact block form after the bf16 rounding,
# the same as tf32x3's (raw N(0, 1) keys: 6e-3, which is why raw keys never take it). "tf32"
# since the H200 A/B at 667cd8c: stage 3 0.451 ms against 0.594 (4 warps), the whole forward at
# S1 1.036 against 1.181, o within 1e-4 (normwise) of the tf32x3 forward. "bf16" (the products'
# fp32 operands rounded to bf16, one bf16 pass: half tf32's tensor-core time and no fp32 operand
# tiles) since the H200 A/B at aeda491 (log row 16): stage 3 0.414 ms against 0.455 (4 warps), the
# whole forward 1.001-1.005 against 1.047 at S1 and 1.736 against 1.776 at B=1 T=32768, o within
# 1.4e-4 (normwise) of the tf32x3 forward (tf32: 1.0e-4); the interpreter rounds as the GPU does,
# so the CPU gate tests this precision.
NORMALISED_KEYS_PREC = "bf16"

# The same forward's inverses of the four diagonal 16x16 blocks of (I + A) (`_unit_lower_inverse16`,
# six dependent batched products): "ieee" (fp32 on FMA units: 768 FFMA per thread, the largest part
# of the kernel's instructions) or "tf32" (tensor cores, one pass; the interpreter truncates as
# `_mm` does). sm_90a, the forward's default form at 4 warps (bf16 products, keys normalised and
# stored, G formed there; counts move by a few percent with the form): "ieee" 255 registers,
# 88-136 B of spills, ~3750 instructions, 768-880 of them FFMA; "tf32" 180-184 registers, no
# spills, ~2830 instructions. "tf32" since the H200 run at
# fab5903 (log row 26): stage 3 0.457 -> 0.306 ms, the whole forward 0.971 -> 0.817 ms at S1 and
# 1.738 -> 1.571 at B=1 T=32768, o within 7e-5 (normwise) of the fp32 inverses'; CPU: the gate's
# l2-normalised 16-bit cases at the same fraction of their bounds over 10 fresh draws each.
NORMALISED_KEYS_DIAG_PREC = "tf32"

# The same for the backward's recompute of stage 3 (its T is stored in fp32 for the gradients):
# "ieee" or "tf32". sm_90a, the recompute at RECOMPUTE_NORMALISED_KEYS_PREC "tf32", 4 warps: "ieee"
# 255 registers, 848 B of spills, 4288 instructions (768 FFMA); "tf32" 255, 84 B, 3176 (log row
# 28). H200, gdn_ab.py at 646b62f, whole backward at S1, same inputs: ieee 10.163 ms, tf32 9.988,
# gradients within 1.6e-4 (normwise) of ieee's; with rows 29 and 30 also on: 9.149. "tf32" since.
RECOMPUTE_NORMALISED_KEYS_DIAG_PREC = "tf32"

# The same for the backward's recompute of stage 3 (T stored in fp32, W and U from fp32 operands
# in fp32, EXACT_WU), when the keys are l2-normalised: "tf32x3" or one-pass "tf32". H200,
# gdn_ab.py at aeda491, S1, normalised keys: 1.441 ms at tf32x3 (4 warps) against 0.921 at tf32,
# T within 4.6e-6 (normwise) of a float64 inverse at tf32 (4.7e-9 at tf32x3), W and U within
# 4e-4 of the exact block form (raw N(0, 1) keys: 4.7e-3 for T, why they keep tf32x3). "tf32"
# since the H200 A/B at 7abdb74 (log row 22): whole backward at S1 11.785 ms against 12.420, the
# gradients within 4.0e-3 of the bf16-products backward (tf32x3: 3.8e-3); CPU: 40 fresh draws of
# each l2-normalised 16-bit gate case within 0.358 of their bounds.
RECOMPUTE_NORMALISED_KEYS_PREC = "tf32"


def solve_form(dtype: torch.dtype, per_channel: bool) -> str:
    return "tile" if SOLVE_FORM == "tile" and not per_channel and dtype != torch.float32 else "blocks"


def chunk_states(k, w, u, G, h0, plan: ChunkPlan, output_final_state: bool, q=None, scale: float = 1.0,
                 out_dtype: torch.dtype | None = None, l2norm_q: bool = False, l2norm_k: bool = False,
                 input_dtype: torch.dtype | None = None, for_backward: bool = False):
    """5: h [NC, H, K, V] (state entering each chunk) and Vn [Ntok, H, V] in W's dtype (see
    `_intermediate_dtype`); the final state [N, H, K, V] fp32, or None. With q (GDN's forward):
    5 and 6 fused, returning (o [Ntok, H, V] in out_dtype, None, final state). l2norm_k: k is
    raw and the kernel normalises it. input_dtype: as in `chunk_solve_wu`; for_backward: the
    backward's recompute, whose recurrence multiplies at `_products(..., True)`'s precision."""
    Ntok, H, K = k.shape
    V = u.shape[-1]
    BK = _blocks(K, V)[0]
    fuse = q is not None
    if fuse:
        h = None
        vn = new_empty((1,), w.dtype, k.device)  # a dtype carrier: Vn is rounded as if stored there
        o = _out((Ntok, H, V), out_dtype, k.device)
    else:
        h = new_empty((plan.NC, H, K, V), w.dtype, k.device)
        vn = new_empty((Ntok, H, V), w.dtype, k.device)
        o = None
    ht = new_empty((plan.N, H, K, V), _F32, k.device) if output_final_state else None
    if plan.N:
        DT, DA, PREC = _products(input_dtype or k.dtype, for_backward, "states")
        # vn stands in for the pointers a form does not use (h0, ht when absent; h, q, o when split/fused)
        _states_kernel[lambda meta: (plan.N * H, cdiv(V, meta["BV"]))](
            k, w, u, G, h0 if h0 is not None else vn, h if h is not None else vn, vn, ht if ht is not None else vn,
            plan.cu, plan.chunk_offsets, H, _programs_bucket(plan.N * H),
            q if fuse else vn, o if fuse else vn, scale, L2NORM_EPS,
            K=K, V=V, BK=BK, BT=BT, HAS_H0=h0 is not None, STORE_FINAL=output_final_state, DT=DT, DA=DA,
            PER_CHANNEL=G.dim() == 3, FUSE_OUTPUT=fuse, L2NORM_Q=l2norm_q, L2NORM_K=l2norm_k, PREC=PREC)
    if fuse:
        return _done(o, out_dtype), None, ht
    return h, vn, ht


def chunk_output(q, k, G, h, vn, scale: float, plan: ChunkPlan, out_dtype: torch.dtype, l2norm_q: bool = False):
    """6: o [Ntok, H, V] in out_dtype; with l2norm_q, q is the raw query and stage 1 happens here."""
    Ntok, H, K = q.shape
    V = vn.shape[-1]
    BK = _blocks(K, V)[0]
    o = _out((Ntok, H, V), out_dtype, q.device)
    if plan.NC:
        DT, DA = _dot_types(q.dtype)
        def grid(meta):
            n_items = plan.NC * cdiv(V, meta["BV"])
            if meta["PER_SM"]:  # persistent: PER_SM programs per SM over all heads
                return (max(1, min(n_items, meta["PER_SM"] * _sm_count(q.device) // H)), H)
            return (n_items, H)

        _output_kernel[grid](q, k, G, h, vn, o, plan.chunks, H, plan.NC, scale, L2NORM_EPS, K=K, V=V, BK=BK, BT=BT,
                             DT=DT, DA=DA, L2NORM_Q=l2norm_q)
    return _done(o, out_dtype)


def chunk_dv_local(q, k, G, do, scale: float, plan: ChunkPlan, input_dtype: torch.dtype | None = None):
    """7: dVl [Ntok, H, V] fp32. input_dtype: the op's input dtype (default q's), for `_products`."""
    Ntok, H, K = q.shape
    V = do.shape[-1]
    BK, BV, NV = _blocks(K, V)
    dvl = new_empty((Ntok, H, V), _F32, q.device)
    if plan.NC:
        _dv_local_kernel[(plan.NC * NV, H)](q, k, G, do, dvl, plan.chunks, H, scale, K, V, BK, BV, NV, BT,
                                           *_products(input_dtype or q.dtype, True, "dv_local"), **_LAUNCH["dv_local"])
    return dvl


def chunk_dstates(q, k, w, G, do, dvl, dht, scale: float, plan: ChunkPlan, want_dh0: bool,
                  input_dtype: torch.dtype | None = None, states_dtype: torch.dtype = torch.float32):
    """8: dh [NC, H, K, V] (gradient of the state leaving each chunk), dVn [Ntok, H, V],
    d initial_state [N, H, K, V] or None; fp32. G [Ntok, H, K] (KDA) selects the per-channel form.
    states_dtype: dh's and dVn's (fp32, or bf16 where a caller takes them so, KDA's
    BACKWARD_DSTATES_DTYPE: stored rounded; the recurrence carries fp32 either way)."""
    Ntok, H, K = q.shape
    V = do.shape[-1]
    BK = _blocks(K, V)[0]
    check_states_dtype(states_dtype)
    dh = new_empty((plan.NC, H, K, V), states_dtype, q.device)
    dvn = new_empty((Ntok, H, V), states_dtype, q.device)
    dh0 = new_empty((plan.N, H, K, V), _F32, q.device) if want_dh0 else None
    if plan.N:
        DT, DA, PREC = _products(input_dtype or q.dtype, True, "dstates")
        _dstates_kernel[lambda meta: (plan.N * H, cdiv(V, meta["BV"]))](
            q, k, w, G, do, dvl, dht if dht is not None else dh, dh, dvn, dh0 if dh0 is not None else dh,
            plan.cu, plan.chunk_offsets, H, _programs_bucket(plan.N * H), scale, K=K, V=V, BK=BK, BT=BT,
            HAS_DHT=dht is not None,
            STORE_DH0=want_dh0, DT=DT, DA=DA, PREC=PREC, PER_CHANNEL=G.dim() == 3)
    return dh, dvn, dh0


def check_states_dtype(states_dtype) -> None:
    """Stage 8's dh and dVn are stored in fp32 or bf16 (`chunk_dstates`' states_dtype)."""
    if states_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"states_dtype must be torch.float32 or torch.bfloat16, got {states_dtype}")


def _key_split(K: int) -> tuple[int, int]:
    """(BKS, NK): 9 works on blocks of BKS key columns, NK of them (see `_dqkwg_kernel`;
    DQKWG_KEY_BLOCK). GDN's and KDA's dqkwg alike, and 10 sums the NK partials of dG."""
    BKS = _key_block("DQKWG_KEY_BLOCK", DQKWG_KEY_BLOCK, _blocks(K, 1)[0])
    return BKS, cdiv(K, BKS)


# How 9 runs: "one" (`_dqkwg_kernel` alone: every block of key columns forms dS, dS^T, D and Q K^T
# again, five accumulators) or "split" (`_dqk_local_kernel` forms them once per chunk and head and
# writes D K, D^T Q in fp32, 0.5 GB more traffic at S1; `_dqkwg_kernel` then keeps the three state
# accumulators). The same products either way. Read at each call. H200, gdn_ab.py at 646b62f, whole
# backward at S1: one 10.163 ms, split 9.919 (gradients within 7e-6 of one's); "split" since.
DQKWG_FORMS = ("one", "split")
DQKWG_FORM = "split"


def chunk_dqkwg(q, k, G, h, dh, vn, dvn, do, scale: float, plan: ChunkPlan, dq_dtype: torch.dtype,
                input_dtype: torch.dtype | None = None):
    """9: dq [Ntok, H, K] in dq_dtype; partial dk, dW [Ntok, H, K] and the partials of dG [NK (+ 1
    in the split form), Ntok, H], fp32."""
    Ntok, H, K = q.shape
    V = do.shape[-1]
    BK, BV, NV = _blocks(K, V)
    BKS, NK = _key_split(K)
    split = _checked("DQKWG_FORM", DQKWG_FORM, DQKWG_FORMS) == "split"
    dq = _out((Ntok, H, K), dq_dtype, q.device)
    dk = new_empty((Ntok, H, K), _F32, q.device)
    dw = new_empty((Ntok, H, K), _F32, q.device)
    dG = new_empty((NK + split, Ntok, H), _F32, q.device)
    if plan.NC:
        products = _products(input_dtype or q.dtype, True, "dqkwg")
        dql = dkl = dk  # stand-ins for the pointers the one-kernel form does not read
        if split:
            dql, dkl = new_empty((Ntok, H, K), _F32, q.device), new_empty((Ntok, H, K), _F32, q.device)
            _dqk_local_kernel[(plan.NC, H)](q, k, G, vn, do, dql, dkl, dG[NK], plan.chunks, H, scale, K, V, BKS, BV, NV,
                                            BT, *products, **_LAUNCH["dqkwg"])
        _dqkwg_kernel[(plan.NC * NK, H)](q, k, G, h, dh, vn, dvn, do, dql, dkl, dq, dk, dw, dG, plan.chunks, H, scale,
                                         Ntok * H, K, V, BKS, BV, NV, BT, *products, not split, **_LAUNCH["dqkwg"])
    return _done(dq, dq_dtype), dk, dw, dG


def _key_block(name: str, block: int, BK: int) -> int:
    """A kernel's block of key columns from the switch `name`: a power of two >= 16, at most BK."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {block}")
    return min(BK, block)


def _wy_key_block(BK: int) -> int:
    return _key_block("WY_BWD_KEY_BLOCK", WY_BWD_KEY_BLOCK, BK)


# How 10 runs: "one" (`_wy_bwd_kernel` PHASE "all") or "split" (PHASE "da" stores dA, dA^T and
# rowsum(V * dU') in fp32, 0.27 GB at S1, and PHASE "apply" finishes from them: each half holds
# fewer [64, 64] fp32 tiles). The same products either way. Read at each call. H200, gdn_ab.py at
# 646b62f, whole backward at S1: one 10.163 ms, split 9.649 (dbeta within 2e-5); "split" since.
WY_BWD_FORMS = ("one", "split")
WY_BWD_FORM = "split"


def chunk_wy_bwd(k, v, beta, G, Ai, w, u, dw, dvn, dkp, dGp, plan: ChunkPlan,
                 dk_dtype: torch.dtype, dv_dtype: torch.dtype, dbeta_dtype: torch.dtype, dg_dtype: torch.dtype,
                 input_dtype: torch.dtype | None = None, raw_k=None):
    """10: dk [Ntok, H, K], dv [Ntok, H, V], dbeta, dg [Ntok, H], each in the dtype asked for. With
    raw_k (k is its l2 normalisation, use_qk_l2norm_in_kernel) dk is raw_k's gradient: stage 11's
    `l2norm_bwd` for k runs here, on this kernel's fp32 dK."""
    if raw_k is not None:
        dk, dv, dbeta, dg = chunk_wy_bwd(k, v, beta, G, Ai, w, u, dw, dvn, dkp, dGp, plan, _F32, dv_dtype,
                                         dbeta_dtype, dg_dtype, input_dtype)
        return l2norm_bwd(raw_k, dk, dk_dtype), dv, dbeta, dg
    Ntok, H, K = k.shape
    V = v.shape[-1]
    BK, BV, NV = _blocks(K, V)
    split = _checked("WY_BWD_FORM", WY_BWD_FORM, WY_BWD_FORMS) == "split"
    dk = _out((Ntok, H, K), dk_dtype, k.device)
    dv = _out((Ntok, H, V), dv_dtype, k.device)
    dbeta = _out((Ntok, H), dbeta_dtype, k.device)
    dg = _out((Ntok, H), dg_dtype, k.device)
    if plan.NC:
        # the one-kernel form reads none of da, dat, vdu: Ai stands in for them there
        da, dat, vdu = ((new_empty((Ntok, H, BT), _F32, k.device), new_empty((Ntok, H, BT), _F32, k.device),
                         new_empty((Ntok, H), _F32, k.device)) if split else (Ai, Ai, Ai))
        for phase in ("da", "apply") if split else ("all",):
            _wy_bwd_kernel[(plan.NC, H)](k, v, beta, G, Ai, w, u, dw, dvn, dkp, dGp, dk, dv, dbeta, dg, da, dat, vdu,
                                         plan.chunks, H, Ntok * H, K, V, BK, BV, NV, BT,
                                         *_products(input_dtype or k.dtype, True, "wy_bwd"), dGp.shape[0],
                                         _wy_key_block(BK), phase, **_LAUNCH["wy_bwd"])
    return _done(dk, dk_dtype), _done(dv, dv_dtype), _done(dbeta, dbeta_dtype), _done(dg, dg_dtype)


# ----------------------------------------------------------------------------------------
# the backend: forward and backward composed from the stages
# ----------------------------------------------------------------------------------------


def _flatten(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> contiguous [B*T, H, ...]."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _recompute(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, plan, output_final_state, for_backward,
               states=None):
    """Stages 1-5: what both the forward and the backward need (T only for the backward, and
    compact intermediates only for the forward, whose output kernel normalises q itself). The
    backward's normalised q and k are fp32 when its products are (`_products`). states: the
    function that runs stage 5 (`chunk_states`'s contract; default `chunk_states`)."""
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        kept = _F32 if for_backward and _products(dtype, True, "keys")[2] != "ieee" else dtype
        k = l2norm_fwd(k, kept)
        if for_backward:
            q = l2norm_fwd(q, kept)
    G = chunk_cumsum(g, plan)
    Ai, w, u = chunk_solve_wu(k, v, beta, G, plan, store_T=for_backward, compact=not for_backward,
                              exact_wu=for_backward, keys_normalised=use_qk_l2norm_in_kernel, input_dtype=dtype)
    h, vn, ht = (states or chunk_states)(k, w, u, G, initial_state, plan, output_final_state, input_dtype=dtype,
                                         for_backward=for_backward)
    return q, k, G, Ai, w, u, h, vn, ht


def fused_forward_stages_1_to_3(kf, vf, gf, bf, plan: ChunkPlan, l2norm: bool, keys_in_kernel_ok: bool = True):
    """Stages 1-3 of a forward whose stages 5 and 6 are one kernel, in the forms the switches ask
    for (L2NORM_K_FORM, CUMSUM_FORM): (keys for the recurrence [Ntok, H, K], G [Ntok, H] fp64,
    W, U compact, whether the recurrence must normalise the keys itself). Shared by Triton's fused
    states kernel and Gluon's; keys_in_kernel_ok=False (a recurrence that takes normalised keys
    only) normalises them in stage 1 where L2NORM_K_FORM says "in-kernel"."""
    # stage 1 for k only when the kernels can't normalise it on load (L2NORM_K_FORM)
    tile = solve_form(kf.dtype, False) == "tile"
    form = L2NORM_K_FORM if l2norm and tile else "stage-1"
    if form == "in-kernel" and not keys_in_kernel_ok:
        form = "stage-1"
    kn = l2norm_fwd(kf) if l2norm and form == "stage-1" else kf
    kn_out = new_empty(kf.shape, kf.dtype, kf.device) if form == "stage-3" else None
    in_stage3 = CUMSUM_FORM == "stage-3" and tile
    G = new_empty(tuple(gf.shape), torch.float64, gf.device) if in_stage3 else chunk_cumsum(gf, plan)
    _Ai, w, u = chunk_solve_wu(kn, vf, bf, G, plan, compact=True, keys_normalised=l2norm,
                               l2norm_k=form != "stage-1", kn_out=kn_out, g=gf if in_stage3 else None)
    return (kn_out if kn_out is not None else kn), G, w, u, form == "in-kernel"


def gdn_forward_triton(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """(o [B, T, H, V] in q's dtype, final state [N, H, K, V] fp32 or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = make_plan(B, T, cu_seqlens, q.device)
    qf, kf, vf, gf, bf = (_flatten(x) for x in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    _check_forward_switches()
    if states_form(plan.N * H) == "fused":
        kn, G, w, u, in_kernel = fused_forward_stages_1_to_3(kf, vf, gf, bf, plan, use_qk_l2norm_in_kernel)
        o, _, ht = chunk_states(kn, w, u, G, h0, plan, output_final_state, q=qf, scale=scale, out_dtype=q.dtype,
                                l2norm_q=use_qk_l2norm_in_kernel, l2norm_k=in_kernel)
        return o.view(B, T, H, V), ht
    q_raw, kn, G, _Ai, _w, _u, h, vn, ht = _recompute(qf, kf, vf, gf, bf, h0, use_qk_l2norm_in_kernel, plan,
                                                      output_final_state, for_backward=False)
    o = chunk_output(q_raw, kn, G, h, vn, scale, plan, q.dtype, l2norm_q=use_qk_l2norm_in_kernel)
    return o.view(B, T, H, V), ht


def _check_forward_switches() -> None:
    """Refuse a forward form the switches do not know, or two that cannot go together (instead of
    one of them silently not taking effect)."""
    _checked("L2NORM_K_FORM", L2NORM_K_FORM, L2NORM_K_FORMS)
    _checked("CUMSUM_FORM", CUMSUM_FORM, CUMSUM_FORMS)
    _checked("WU_FORM", WU_FORM, ("fused", "split"))
    _t_chain()
    if WU_FORM == "split" and (L2NORM_K_FORM != "stage-1" or CUMSUM_FORM != "stage-2"):
        raise ValueError(f"WU_FORM 'split' reads the keys stage 1 normalised and the G stage 2 formed: it needs "
                         f"L2NORM_K_FORM 'stage-1' and CUMSUM_FORM 'stage-2' (got {L2NORM_K_FORM!r}, {CUMSUM_FORM!r})")


# The forward's stages 5 and 6: "split" (`_states_kernel` stores h and Vn, `_output_kernel` reads
# them), "fused" (`_states_kernel` with FUSE_OUTPUT: h and Vn never leave the chip), or "auto":
# fused when there are at least FUSED_STATES_MIN_PAIRS (sequence, head) pairs, split otherwise.
# Read at each call, so scripts/gdn_ab.py can time each. H200, gdn_ab.py at 667cd8c, whole
# forward: S1 (128 pairs) fused 1.181 ms against split 1.230; B=1 T=32768 (16 pairs) fused 3.078
# against split 1.890: with few pairs the fused kernel's longer per-chunk chain runs on few SMs
# (16 x 4 V blocks = 64 programs) while the split output kernel spreads over every chunk. The
# threshold lies between 16 and 128 pairs (not measured in between); 64 pairs, about half the
# H200's 132 SMs, is a guess in that range. The backward keeps the split states kernel (it needs h).
STATES_FORM = "auto"
FUSED_STATES_MIN_PAIRS = 64


def states_form(pairs: int) -> str:
    """"fused" or "split" for a forward over `pairs` (sequence, head) pairs (STATES_FORM)."""
    if _checked("STATES_FORM", STATES_FORM, ("split", "fused", "auto")) == "auto":
        return "fused" if pairs >= FUSED_STATES_MIN_PAIRS else "split"
    return STATES_FORM

# Where the fused forward normalises k (use_qk_l2norm_in_kernel): "stage-1" (`l2norm_fwd` writes
# the normalised keys, 0.062 ms at S1 on the H200, 5031cf0, and the two kernels read them) or
# "in-kernel" (stage 3's tile kernel and the fused states kernel normalise the raw keys as they
# load them: 268 MB less traffic at S1, ~0.06 ms predicted; measured slower at 667cd8c, 1.224 ms
# against 1.181, from the extra spills) or "stage-3" (stage 3's tile kernel normalises the raw keys
# as it loads them and stores them for the states kernel: stage 1's kernel and its second read of
# k are gone, the states kernel is unchanged; log row 19). The same keys in every form (stage 3
# rounds them as stage 1 does): bitwise-equal forwards under the interpreter.
L2NORM_K_FORMS = ("stage-1", "in-kernel", "stage-3")
L2NORM_K_FORM = "stage-3"

# Where the fused forward forms G, the gates' in-chunk sums: "stage-2" (`_cumsum_kernel`, its own
# launch: 13 us under ncu at S1, aeda491) or "stage-3" (the tile solve sums the raw gates as it
# loads them, the same fp64 sum, and stores G for the states kernel: one launch fewer). The same
# G either way: bitwise-equal forwards under the interpreter. "stage-3" since the H200 A/B at
# 7abdb74 (log row 20): whole forward at S1 0.957 ms against 0.996.
CUMSUM_FORMS = ("stage-2", "stage-3")
CUMSUM_FORM = "stage-3"

# How the tile form of stage 3 finishes T from M = D A_off (every tile-form call, forward and the
# backward's recompute): "horner", T = D - M (D - M (D - M D)), three dependent [64, 64] products
# after M; or "factored", T = (I + M^2)(I - M) D, where M D and M^2 are independent, so two
# dependent products after M (the same four products, the same polynomial; four tiles live, and
# sm_90a gives the same 144 B of spills at 4 warps). Stage 3 is latency-bound (ncu at aeda491:
# 2 CTAs per SM, 0.28 instructions issued per cycle per scheduler). Off until timed (log row 21).
T_CHAINS = ("horner", "factored")
T_CHAIN = "horner"


def _t_chain() -> str:
    return _checked("T_CHAIN", T_CHAIN, T_CHAINS)


def gdn_backward_triton(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                        stages: dict | None = None):
    """(dq, dk, dv, dg, dbeta, d initial_state or None), each in its input's dtype. Recomputes
    stages 1-5, then runs 7-11; dht (gradient of the final state) may be None. stages: functions
    that run a stage instead of this module's, by name ("states": the recompute's stage 5, with
    `chunk_states`'s contract; "dstates": stage 8, `chunk_dstates`'s; "dqkwg": stage 9,
    `chunk_dqkwg`'s; "wy_bwd": stage 10 with stage 11 for k, `chunk_wy_bwd`'s; "dv_local": stage 7, `chunk_dv_local`'s
    with vn=, the recompute's Vn, as well); the gluon backend passes its own."""
    stages = stages or {}
    B, T, H, K = q.shape
    plan = make_plan(B, T, cu_seqlens, q.device)
    qf, kf, vf, gf, bf = (_flatten(x) for x in (q, k, v, g, beta))
    dof = _flatten(do.to(q.dtype))
    h0 = initial_state.contiguous() if initial_state is not None else None
    dht = dht.contiguous() if dht is not None else None
    qn, kn, G, Ai, w, u, h, vn, _ = _recompute(qf, kf, vf, gf, bf, h0, use_qk_l2norm_in_kernel, plan, False,
                                               for_backward=True, states=stages.get("states", chunk_states))
    dt = q.dtype
    dv_local = stages.get("dv_local")
    dvl = (dv_local(qn, kn, G, dof, scale, plan, input_dtype=dt, vn=vn) if dv_local is not None
           else chunk_dv_local(qn, kn, G, dof, scale, plan, input_dtype=dt))
    dh, dvn, dh0 = stages.get("dstates", chunk_dstates)(qn, kn, w, G, dof, dvl, dht, scale, plan, h0 is not None,
                                                         input_dtype=dt)
    l2 = use_qk_l2norm_in_kernel
    dq, dkp, dw, dGp = stages.get("dqkwg", chunk_dqkwg)(qn, kn, G, h, dh, vn, dvn, dof, scale, plan,
                                                        _F32 if l2 else q.dtype, input_dtype=dt)
    # with l2 the stage takes dk back through k's normalisation too (stage 11 for k)
    dk, dv, dbeta, dg = stages.get("wy_bwd", chunk_wy_bwd)(kn, vf, bf, G, Ai, w, u, dw, dvn, dkp, dGp, plan,
                                                           k.dtype, v.dtype, beta.dtype, g.dtype, input_dtype=dt,
                                                           raw_k=kf if l2 else None)
    if l2:
        dq = l2norm_bwd(qf, dq, q.dtype)
    if dh0 is not None and dh0.dtype != initial_state.dtype:
        dh0 = dh0.to(initial_state.dtype)
    return (dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dg.view(g.shape), dbeta.view(beta.shape), dh0)
