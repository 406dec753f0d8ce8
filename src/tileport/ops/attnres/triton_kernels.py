"""AttnRes, Triton backend: forward and backward kernels for `fused_attnres`.

Per token row n (L residual sources r_l [N, D], all math in fp32):
    qw = query * rms_weight;  rstd_l = rsqrt(mean(r_l^2) + eps);  s_l = scale * rstd_l * <r_l, qw>
    p = softmax_l(s);  o_pre = sum_l p_l r_l;  o = o_pre * rstd_o * ow  (rstd_o of o_pre; only with ow)

Design (bandwidth bound; the floor is (L+1)*N*D elements forward, (2L+1)*N*D backward):
- The L sources stay L separate tensors (never stacked). Kernels take them as a tuple of
  pointers (Triton tuple arguments); L is a constexpr, capped at MAX_L.
- A program owns BLOCK_N whole rows (BLOCK_D = next_pow2(D), masked), so every reduction
  over D stays inside the program.
- Two ways to hold the sources, chosen on the host by a register budget:
  * GATHER: the L base pointers are selected into an [LP] pointer vector (LP = next_pow2(L)),
    and one load brings a [BLOCK_N, LP, BLOCK_D] tile of all sources into registers. All
    row sums over D for all sources then come out of ONE reduction (one cross-warp exchange
    per pass instead of one per source), the softmax over l is an exact (not online) one
    on a [BLOCK_N, LP] tile, and sums over l are in-thread.
  * STREAM (large L*D): a runtime loop over l visits one [BLOCK_N, BLOCK_D] source tile at
    a time (one tile ahead; the source's base pointer picked from the tuple by a select
    chain), with an online softmax, and re-reads sources when a later pass needs them.
    Per-row statistics are kept in [BLOCK_N, LP] tiles. A runtime (not unrolled) loop keeps
    the register footprint at one source tile whatever L is.
- Forward: grid over row tiles; every source row is read once, o (and p) written once.
  Traffic (L+1)*N*D elements (+ 4*L*N bytes for p).
- Backward: persistent programs loop over row tiles; per tile it recomputes the forward
  statistics, dp_l = <do, r_l> for every l, then ds and every d r_l, written once. Only the
  first read of r_l goes to HBM (GATHER: later passes use registers; STREAM: re-reads of
  rows the program touched microseconds earlier hit L2). Traffic (2L+1)*N*D elements.
  The parameter-gradient sums (G for query/rms_weight, and dow) stay in registers and are
  written once per program as fp32 rows [P, D]; `finish_parameter_grads` reduces them.
- Softmax backward: delta = sum_k p_k dp_k is formed from the per-source dp_k, pivoted on the
  arg-max source c: ds_l = p_l ((dp_l - c) - sum_k p_k (dp_k - c)). Forming delta as
  <do, o_pre> instead (cheaper) loses all precision in fp32 once the softmax saturates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.envvars import getenv
from tileport.shapes import cdiv, next_pow2
from tileport.memory import new_empty

from .common import finish_parameter_grads

MAX_L = 32  # largest number of sources the kernels are unrolled for
MAX_D = 16384  # largest row width held in registers

_GPU_PROGRAMS = 528  # persistent backward programs on GPU (4 per SM on a 132-SM H200)
_INTERPRETER_PROGRAMS = 3  # few programs under TRITON_INTERPRET so each one loops over tiles
_TILE_ELEMENTS = 2048  # target BLOCK_N * BLOCK_D (elements of one source per program)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tuning knobs (module constants so that a GPU sweep can patch them; see _launch_config).
# GATHER mode when the [BLOCK_N, LP, BLOCK_D] tile needs at most this many elements per thread.
_FWD_GATHER_ELEMS = 64
_BWD_GATHER_ELEMS = 64
_FWD_WARPS = None  # None: 4 for BLOCK_D <= 1024, 8 for 2048, 16 beyond
_BWD_WARPS = None
_FWD_MAXNREG = None  # ptxas register cap (occupancy); None leaves it to ptxas
_BWD_MAXNREG = None
_FORCE_FUSED = None  # tests only: force the fused-reduction choice

# Cache policies (constexpr kernel arguments, kept here so they are easy to tune on the GPU).
_FWD_POLICY = "evict_first"  # forward reads each source once
_BWD_FIRST_POLICY = ""  # backward STREAM, first read of a row (re-read later from L2)
_BWD_LAST_POLICY = "evict_first"  # backward, last read of a row


# ----------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------


def _launch_config(N: int, D: int, L: int, backward: bool) -> dict:
    """Tile shape, warps, register cap and GATHER/STREAM mode for L sources of N rows of width D.

    Returns BLOCK_N, BLOCK_D, LP, GATHER (constexprs) and launch options num_warps, maxnreg.
    """
    block_d = max(16, next_pow2(D))
    lp = next_pow2(L)
    num_warps = _BWD_WARPS if backward else _FWD_WARPS
    if num_warps is None:
        num_warps = 4 if block_d <= 1024 else (8 if block_d <= 2048 else 16)
    maxnreg = _BWD_MAXNREG if backward else _FWD_MAXNREG
    threads = 32 * num_warps
    budget = _BWD_GATHER_ELEMS if backward else _FWD_GATHER_ELEMS
    stream_n = max(1, min(_TILE_ELEMENTS // block_d, next_pow2(N)))
    gather_n = min(stream_n, (budget * threads) // (lp * block_d))
    cfg = dict(BLOCK_D=block_d, LP=lp, num_warps=num_warps, maxnreg=maxnreg)
    if gather_n >= 1:
        return dict(cfg, BLOCK_N=1 << (gather_n.bit_length() - 1), GATHER=True)
    return dict(cfg, BLOCK_N=stream_n, GATHER=False)


def _launch_options(cfg: dict) -> dict:
    opts = dict(num_warps=cfg["num_warps"], num_stages=1)
    if cfg["maxnreg"] is not None:
        opts["maxnreg"] = cfg["maxnreg"]
    return opts


def _interpreting(device: torch.device) -> bool:
    return getenv("TRITON_INTERPRET", "0") == "1" or device.type == "cpu"


def _fused_reductions(device: torch.device) -> bool:
    """Fuse sibling row sums into one multi-operand tl.reduce on GPU. The interpreter runs a
    custom combine function as a Python loop over the row, so there it uses plain tl.sum."""
    if _FORCE_FUSED is not None:
        return _FORCE_FUSED
    return not _interpreting(device)


def _persistent_programs(num_tiles: int, device: torch.device) -> int:
    cap = _INTERPRETER_PROGRAMS if _interpreting(device) else _GPU_PROGRAMS
    return max(1, min(num_tiles, cap))


def triton_refusal(L: int, D: int, dtype) -> str | None:
    """None when the Triton kernels accept this problem, else a one-line reason."""
    if L < 1:
        return "AttnRes needs at least one residual source"
    if L > MAX_L:
        return f"L={L} sources is over the Triton unroll cap MAX_L={MAX_L}"
    if D < 1:
        return "AttnRes needs D >= 1"
    if D > MAX_D:
        return f"D={D} is over the Triton register cap MAX_D={MAX_D}"
    if dtype not in _SUPPORTED_DTYPES:
        return f"residual dtype {dtype} is not one of float32, float16, bfloat16"
    return None


# ----------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _sums2(a, b, AXIS: tl.constexpr, FUSED: tl.constexpr):
    """Sums of two same-shape tiles along AXIS (one fused reduction when FUSED)."""
    if FUSED:
        x, y = tl.reduce((a, b), AXIS, _add2)
    else:
        x = tl.sum(a, AXIS)
        y = tl.sum(b, AXIS)
    return x, y


@triton.jit
def _sums3(a, b, c, AXIS: tl.constexpr, FUSED: tl.constexpr):
    """Sums of three same-shape tiles along AXIS (one fused reduction when FUSED)."""
    if FUSED:
        x, y, z = tl.reduce((a, b, c), AXIS, _add3)
    else:
        x = tl.sum(a, AXIS)
        y = tl.sum(b, AXIS)
        z = tl.sum(c, AXIS)
    return x, y, z


@triton.jit
def _load_f32(ptrs, mask, MASKED: tl.constexpr, POLICY: tl.constexpr):
    """Load a tile (masked lanes read 0) and widen it to fp32."""
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)
    else:
        x = tl.load(ptrs, eviction_policy=POLICY)
    return x.to(tl.float32)


@triton.jit
def _store(ptrs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty))


@triton.jit
def _source_bases(ptrs, L: tl.constexpr, LP: tl.constexpr):
    """[LP] vector of the L base pointers of the tuple `ptrs` (slots >= L repeat slot 0)."""
    idx = tl.arange(0, LP)
    base = ptrs[0] + tl.zeros([LP], dtype=tl.int32)
    for l in tl.static_range(1, L):
        base = tl.where(idx == l, ptrs[l], base)
    return base


@triton.jit
def _softmax_rows(s, L: tl.constexpr, LP: tl.constexpr):
    """Softmax over axis 1 of s [BLOCK_N, LP] whose slots >= L are padding.

    Returns (s with padding at -inf, row max m, p)."""
    if LP != L:
        s = tl.where((tl.arange(0, LP) < L)[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    e = tl.exp(s - m[:, None])
    p = e * (1.0 / tl.sum(e, 1))[:, None]
    return s, m, p


@triton.jit
def _pick(ptrs, l, L: tl.constexpr):
    """Base pointer of source `l` (a runtime index) from the tuple `ptrs`: a chain of L-1
    uniform selects, which keeps the pointers' 16-byte alignment visible to the compiler."""
    p = ptrs[0]
    for k in tl.static_range(1, L):
        p = tl.where(l == k, ptrs[k], p)
    return p


@triton.jit
def _column(t, lidx, l):
    """Column l (runtime) of a [BLOCK_N, LP] tile, as a [BLOCK_N] vector."""
    return tl.sum(tl.where(lidx[None, :] == l, t, 0.0), 1)


@triton.jit
def _put_column(t, lidx, l, v):
    """Tile t [BLOCK_N, LP] with column l replaced by v [BLOCK_N]."""
    return tl.where(lidx[None, :] == l, v[:, None], t)


@triton.jit
def _stream_stats(res, dy, offs, mask, qw, eps, scale,
                  L: tl.constexpr, LP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  WITH_DP: tl.constexpr, POLICY: tl.constexpr, FUSED: tl.constexpr):
    """STREAM mode: one pass over the sources (a runtime loop over l, loads one tile ahead).

    Online softmax. Returns (m, den, acc, S, RSTD, DOT, DP): running max / denominator
    [BLOCK_N], acc = sum_l exp(s_l - m) r_l [BLOCK_N, BLOCK_D], and [BLOCK_N, LP] tiles of
    s_l (padding -inf), rstd_l, <r_l, qw> and, when WITH_DP, dp_l = <dy, r_l> (else zeros).
    """
    inv_d: tl.constexpr = 1.0 / D
    lidx = tl.arange(0, LP)
    S = tl.full([BLOCK_N, LP], float("-inf"), tl.float32)
    RSTD = tl.zeros([BLOCK_N, LP], dtype=tl.float32)
    DOT = tl.zeros([BLOCK_N, LP], dtype=tl.float32)
    DP = tl.zeros([BLOCK_N, LP], dtype=tl.float32)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    nxt = _load_f32(res[0] + offs, mask, True, POLICY)
    for l in range(L):
        r = nxt
        nxt = _load_f32(_pick(res, l + 1, L) + offs, mask & (l + 1 < L), True, POLICY)
        if WITH_DP:
            sq, dot, dp = _sums3(r * r, r * qw, r * dy, 1, FUSED)
            DP = _put_column(DP, lidx, l, dp)
        else:
            sq, dot = _sums2(r * r, r * qw, 1, FUSED)
        rstd = tl.rsqrt(sq * inv_d + eps)
        s = scale * rstd * dot
        m_new = tl.maximum(m, s)
        alpha = tl.exp(m - m_new)  # 0 on the first source (m = -inf)
        e = tl.exp(s - m_new)
        den = den * alpha + e
        acc = acc * alpha[:, None] + e[:, None] * r
        m = m_new
        S = _put_column(S, lidx, l, s)
        RSTD = _put_column(RSTD, lidx, l, rstd)
        DOT = _put_column(DOT, lidx, l, dot)
    return m, den, acc, S, RSTD, DOT, DP


@triton.jit
def _stream_dots(res, v, offs, mask, L: tl.constexpr, LP: tl.constexpr, BLOCK_N: tl.constexpr,
                 POLICY: tl.constexpr):
    """STREAM mode: [BLOCK_N, LP] tile of row dots <v, r_l> (runtime loop, one tile ahead)."""
    lidx = tl.arange(0, LP)
    DP = tl.zeros([BLOCK_N, LP], dtype=tl.float32)
    nxt = _load_f32(res[0] + offs, mask, True, POLICY)
    for l in range(L):
        r = nxt
        nxt = _load_f32(_pick(res, l + 1, L) + offs, mask & (l + 1 < L), True, POLICY)
        DP = _put_column(DP, lidx, l, tl.sum(v * r, 1))
    return DP


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _attnres_fwd_kernel(  # lint: allow-function TP001 -- the L sources are separate tensors gathered through a pointer vector; no descriptor spans them, and this is the portable baseline
    res, q_ptr, w_ptr, ow_ptr, o_ptr, p_ptr,
    N, eps, scale,
    L: tl.constexpr, LP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr,
    HAS_OW: tl.constexpr, RETURN_P: tl.constexpr, MASK_N: tl.constexpr, MASK_D: tl.constexpr,
    POLICY: tl.constexpr, FUSED: tl.constexpr,
):
    """AttnRes forward for one tile of BLOCK_N rows.

    Grid: (cdiv(N, BLOCK_N),). The program reads its rows of the L sources once: GATHER, as
    one [BLOCK_N, LP, BLOCK_D] load through a pointer vector, one fused reduction for all
    sum(r^2) and <r, qw>, an exact softmax over l and an in-thread sum over l; STREAM, a
    runtime loop over l (one tile ahead) with an online softmax. Writes o (and p [L, N] fp32
    when RETURN_P) once. Explicit here: int64 row offsets, masks only when D, N or L is
    ragged, the eviction hint on source loads, qw = query * rms_weight formed in fp32 by
    every program (2*D cached loads).
    """
    MASKED: tl.constexpr = MASK_N or MASK_D
    inv_d: tl.constexpr = 1.0 / D
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    lidx = tl.arange(0, LP)
    cmask = cols < D
    rmask = rows < N
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]  # [BLOCK_N, BLOCK_D]
    mask = rmask[:, None] & cmask[None, :]

    q = tl.load(q_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    qw = (q * w)[None, :]

    if GATHER:
        ptrs = _source_bases(res, L, LP)[None, :, None] + offs[:, None, :]
        mask3 = mask[:, None, :] & (lidx < L)[None, :, None]
        r = _load_f32(ptrs, mask3, MASKED or (LP != L), POLICY)  # [BLOCK_N, LP, BLOCK_D]
        sq, dot = _sums2(r * r, r * qw[:, None, :], 2, FUSED)  # [BLOCK_N, LP]
        s = scale * tl.rsqrt(sq * inv_d + eps) * dot
        s, m, p = _softmax_rows(s, L, LP)
        o = tl.sum(p[:, :, None] * r, 1)
    else:
        m, den, acc, S, RSTD, DOT, DP = _stream_stats(
            res, qw, offs, mask, qw, eps, scale, L, LP, D, BLOCK_N, False, POLICY, FUSED)
        inv_den = 1.0 / den
        o = acc * inv_den[:, None]
        p = tl.exp(S - m[:, None]) * inv_den[:, None]
    if HAS_OW:
        ow = tl.load(ow_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd_o = tl.rsqrt(tl.sum(o * o, 1) * inv_d + eps)
        o = o * rstd_o[:, None] * ow[None, :]
    _store(o_ptr + offs, o, mask, MASKED)

    if RETURN_P:
        p_ptrs = p_ptr + (lidx.to(tl.int64) * N)[None, :] + rows.to(tl.int64)[:, None]
        _store(p_ptrs, p, rmask[:, None] & (lidx < L)[None, :], MASK_N or (LP != L))


@triton.jit
def _attnres_bwd_kernel(  # lint: allow-function TP001 -- the L sources are separate tensors gathered through a pointer vector; no descriptor spans them, and this is the portable baseline
    res, dres, dy_ptr, q_ptr, w_ptr, ow_ptr, gqw_ptr, gow_ptr,
    N, eps, scale,
    L: tl.constexpr, LP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr,
    HAS_OW: tl.constexpr, MASK_N: tl.constexpr, MASK_D: tl.constexpr,
    FIRST_POLICY: tl.constexpr, LAST_POLICY: tl.constexpr, FUSED: tl.constexpr,
):
    """AttnRes backward, persistent over row tiles.

    Grid: (P,), P = min(number of row tiles, ~4 per SM). Program `pid` handles tiles
    pid, pid + P, ... Per tile it reads dy and the L sources once from HBM and
      1. recomputes rstd_l, <r_l, qw>, s_l, p, o_pre (plus dp_l = <dy, r_l> when do = dy);
      2. with the output norm (HAS_OW): do = rstd_o g - o_pre rstd_o^3 mean(g o_pre),
         g = dy ow, then dp_l = <do, r_l>;
      3. ds_l = p_l ((dp_l - c) - sum_k p_k (dp_k - c)), c = dp at the arg-max source;
      4. writes d r_l = p_l do + c_l (qw - rstd_l^2 <r_l, qw> r_l / D), c_l = ds_l scale rstd_l.
    GATHER keeps the [BLOCK_N, LP, BLOCK_D] source tile in registers (one fused reduction per
    step); STREAM runs a runtime loop over l per step, re-reading rows from L2 in steps 2, 4.
    Per-row statistics live in [BLOCK_N, LP] tiles. The fp32 sums G = sum ds_l rstd_l r_l and
    dow = sum dy o_pre rstd_o stay in registers and are written once, as row `pid` of
    gqw [P, D] / gow [P, D]. Explicit here: int64 row offsets, masks only when ragged,
    one-ahead prefetch in STREAM, per-read cache hints.
    """
    MASKED: tl.constexpr = MASK_N or MASK_D
    MASK3: tl.constexpr = MASKED or (LP != L)
    inv_d: tl.constexpr = 1.0 / D
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    lidx = tl.arange(0, LP)
    cmask = cols < D
    if HAS_OW:
        gow_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    g_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if GATHER:
        src = _source_bases(res, L, LP)[None, :, None]
        dst = _source_bases(dres, L, LP)[None, :, None]
        lmask = (lidx < L)[None, :, None]

    num_tiles = tl.cdiv(N, BLOCK_N)
    for tile in range(pid, num_tiles, nprog):
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        mask = (rows < N)[:, None] & cmask[None, :]
        dy = _load_f32(dy_ptr + offs, mask, MASKED, "evict_first")
        # the [D] parameters are re-read per tile (L1 hits) rather than held in registers
        q = tl.load(q_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        qw = (q * w)[None, :]

        # 1. forward statistics
        if GATHER:
            mask3 = mask[:, None, :] & lmask
            r = _load_f32(src + offs[:, None, :], mask3, MASK3, LAST_POLICY)
            if HAS_OW:
                sq, DOT = _sums2(r * r, r * qw[:, None, :], 2, FUSED)
            else:
                sq, DOT, DP = _sums3(r * r, r * qw[:, None, :], r * dy[:, None, :], 2, FUSED)
            RSTD = tl.rsqrt(sq * inv_d + eps)
            S, m, P = _softmax_rows(scale * RSTD * DOT, L, LP)
            o_pre = tl.sum(P[:, :, None] * r, 1)
        else:
            m, den, acc, S, RSTD, DOT, DP = _stream_stats(
                res, dy, offs, mask, qw, eps, scale, L, LP, D, BLOCK_N, not HAS_OW,
                FIRST_POLICY, FUSED)
            inv_den = 1.0 / den
            o_pre = acc * inv_den[:, None]
            P = tl.exp(S - m[:, None]) * inv_den[:, None]

        # 2. through the output norm
        if HAS_OW:
            ow = tl.load(ow_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            g = dy * ow
            sq_o, go = _sums2(o_pre * o_pre, g * o_pre, 1, FUSED)
            rstd_o = tl.rsqrt(sq_o * inv_d + eps)
            do = rstd_o[:, None] * g - o_pre * (rstd_o * rstd_o * rstd_o * go * inv_d)[:, None]
            gow_acc += dy * o_pre * rstd_o[:, None]
            if GATHER:
                DP = tl.sum(r * do[:, None, :], 2)
            else:
                DP = _stream_dots(res, do, offs, mask, L, LP, BLOCK_N, FIRST_POLICY)
        else:
            do = dy

        # 3. softmax backward, pivoted on the arg-max source
        piv = tl.max(tl.where(S == m[:, None], DP, float("-inf")), 1)
        DPC = DP - piv[:, None]
        delta = tl.sum(P * DPC, 1)
        DS = P * (DPC - delta[:, None])
        C = DS * scale * RSTD
        K = C * RSTD * RSTD * DOT * inv_d
        GS = DS * RSTD

        # 4. d r_l and the G partial sums
        if GATHER:
            dr = (P[:, :, None] * do[:, None, :] + C[:, :, None] * qw[:, None, :]
                  - K[:, :, None] * r)
            _store(dst + offs[:, None, :], dr, mask3, MASK3)
            g_acc += tl.sum(GS[:, :, None] * r, 1)
        else:
            nxt = _load_f32(res[0] + offs, mask, True, LAST_POLICY)
            for l in range(L):
                r = nxt
                nxt = _load_f32(_pick(res, l + 1, L) + offs, mask & (l + 1 < L), True,
                                LAST_POLICY)
                p_l = _column(P, lidx, l)
                c_l = _column(C, lidx, l)
                k_l = _column(K, lidx, l)
                gs_l = _column(GS, lidx, l)
                dr = p_l[:, None] * do + c_l[:, None] * qw - k_l[:, None] * r
                _store(_pick(dres, l, L) + offs, dr, mask, MASKED)
                g_acc += gs_l[:, None] * r

    out = pid.to(tl.int64) * D + cols
    tl.store(gqw_ptr + out, tl.sum(g_acc, 0), mask=cmask)
    if HAS_OW:
        tl.store(gow_ptr + out, tl.sum(gow_acc, 0), mask=cmask)


# ----------------------------------------------------------------------------------------
# stages (one per kernel launch)
# ----------------------------------------------------------------------------------------


def _check(query, residuals, rms_weight, output_rms_weight):
    L = len(residuals)
    N, D = residuals[0].shape
    reason = triton_refusal(L, D, residuals[0].dtype)
    if reason is not None:
        raise ValueError(reason)
    for r in residuals:
        assert r.shape == (N, D) and r.dtype == residuals[0].dtype and r.is_contiguous()
        assert r.device == residuals[0].device
    for t in (query, rms_weight, output_rms_weight):
        assert t is None or (t.numel() == D and t.is_contiguous())
    return L, N, D


def _forward_stage(query, residuals, rms_weight, output_rms_weight, eps, scale, return_weights):
    """Launch the forward kernel: returns o [N, D] and p [L, N] fp32 (or None)."""
    L, N, D = _check(query, residuals, rms_weight, output_rms_weight)
    device = residuals[0].device
    cfg = _launch_config(N, D, L, backward=False)
    o = new_empty((N, D), residuals[0].dtype, device)
    p = new_empty((L, N), torch.float32, device) if return_weights else None
    has_ow = output_rms_weight is not None
    grid = (cdiv(N, cfg["BLOCK_N"]),)
    _attnres_fwd_kernel[grid](
        tuple(residuals), query, rms_weight, output_rms_weight if has_ow else query, o,
        p if return_weights else o,
        N, float(eps), float(scale),
        L=L, LP=cfg["LP"], D=D, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
        GATHER=cfg["GATHER"], HAS_OW=has_ow, RETURN_P=bool(return_weights),
        MASK_N=(N % cfg["BLOCK_N"] != 0), MASK_D=(D != cfg["BLOCK_D"]),
        POLICY=_FWD_POLICY, FUSED=_fused_reductions(device),
        **_launch_options(cfg),
    )
    return o, p


def _backward_stage(grad_o, query, residuals, rms_weight, output_rms_weight, eps, scale):
    """Launch the persistent backward kernel.

    Returns (grad_residuals list, qw_partials [P, D] fp32, out_w_partials [P, D] fp32 or None).
    """
    L, N, D = _check(query, residuals, rms_weight, output_rms_weight)
    assert grad_o.shape == (N, D) and grad_o.is_contiguous()
    device = residuals[0].device
    cfg = _launch_config(N, D, L, backward=True)
    num_tiles = cdiv(N, cfg["BLOCK_N"])
    programs = _persistent_programs(num_tiles, device)
    has_ow = output_rms_weight is not None
    grads = [new_empty((N, D), residuals[0].dtype, device) for _ in range(L)]
    qw_partials = new_empty((programs, D), torch.float32, device)
    ow_partials = new_empty((programs, D), torch.float32, device) if has_ow else None
    _attnres_bwd_kernel[(programs,)](
        tuple(residuals), tuple(grads), grad_o, query, rms_weight,
        output_rms_weight if has_ow else query,
        qw_partials, ow_partials if has_ow else qw_partials,
        N, float(eps), float(scale),
        L=L, LP=cfg["LP"], D=D, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
        GATHER=cfg["GATHER"], HAS_OW=has_ow,
        MASK_N=(N % cfg["BLOCK_N"] != 0), MASK_D=(D != cfg["BLOCK_D"]),
        FIRST_POLICY=_BWD_FIRST_POLICY, LAST_POLICY=_BWD_LAST_POLICY,
        FUSED=_fused_reductions(device),
        **_launch_options(cfg),
    )
    return grads, qw_partials, ow_partials


# ----------------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------------


def attnres_forward_triton(query, residuals, rms_weight, output_rms_weight, eps: float, scale: float,
                           return_weights: bool):
    """o [N, D] in the residual dtype, and p [L, N] fp32 when return_weights else None."""
    return _forward_stage(query, tuple(residuals), rms_weight, output_rms_weight, eps, scale,
                          return_weights)


def attnres_backward_triton(grad_o, query, residuals, rms_weight, output_rms_weight, eps, scale):
    """(grad_residuals [L x [N, D]], grad_query [D], grad_rms_weight [D], grad_output_rms_weight or None).

    Everything is recomputed from the inputs; the forward saves nothing.
    """
    grads, qw_partials, ow_partials = _backward_stage(
        grad_o, query, tuple(residuals), rms_weight, output_rms_weight, eps, scale)
    grad_query, grad_rms_weight, grad_out_w = finish_parameter_grads(
        qw_partials, ow_partials, query, rms_weight, output_rms_weight, scale)
    return grads, grad_query, grad_rms_weight, grad_out_w
