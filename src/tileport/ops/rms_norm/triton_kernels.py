"""RMSNorm, Triton backend: one forward and one backward launch (plus one for the d weight sum).

Per row of x [M, D] (fp32 math, any input dtype):
    rstd = rsqrt(sum(x^2) / D + eps);  y = x * rstd * w
    g = dy * w;  dx = rstd * g - x * (rstd^3 * sum(g * x) / D);  dw = sum_rows dy * x * rstd
    (fp32 inputs: dx = rstd (g - x rstd^2 sum(g x) / D) in fp64, `_rms_norm_bwd_kernel`'s FP64_SUMS)

Design (bandwidth bound: forward moves 2*M*D elements, backward 3*M*D):
- A program owns BLOCK_M whole rows. When next_pow2(D) <= _MAX_TILE_D the row tile stays in
  registers (ONE_TILE): one read of each input. Wider rows are walked in column chunks of
  BLOCK_D: a first pass forms the row sums, a second re-reads the chunks (hot in L2) and writes.
- 2D tiles move through tensor descriptors (`tl.make_tensor_descriptor`, TMA on Hopper) when the
  base pointers and row strides are 16-byte aligned; otherwise (or before sm_90) through masked
  raw pointers. Out-of-range rows and columns read as 0 either way, which every formula here
  tolerates (a zero row gives rstd = rsqrt(eps), finite, and is never stored).
- Backward programs are persistent: each loops over row tiles (software-pipelined, ONE_TILE) and
  keeps its d weight partial sum in registers (ONE_TILE), or read-modify-writes its own fp32 row of
  `partials` (chunked; a barrier per tile orders those accesses inside the CTA). Its row tile,
  pipeline depth and programs per SM are autotuned (`BWD_OPTIONS`). `partials [P, D]` is summed
  in a fixed order into the weight's dtype by `triton_rows.sum_partial_rows` (one small launch).
  The gradients are the same bits from call to call once a key is tuned; the autotuner's pick (by
  timing, at a key's first call) sets P and each program's rows, so another process may pick
  another candidate and round dw (and dx's row sums) otherwise, within the gate's bounds. That
  first call times every candidate, which CUDA-graph capture does not allow: call each shape once
  before capturing it (the grouped GEMM's autotuned kernel asks the same).

The row-tile machinery (descriptor or raw-pointer row tiles, launch configuration, the TMA scratch
allocator) lives in `tileport/triton_rows.py`, shared with softmax, rope and grouped GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tileport.autotuning import tuned
from tileport.dispatch import interpreter_enabled
from tileport.shapes import cdiv, next_pow2
from tileport.memory import as_rows, new_empty
from tileport.triton_rows import (  # the row-tile machinery shared by the row-wise ops
    _load_rows,
    _load_vec,
    _make_rows_desc,
    _store_rows,
    descriptors_fit,
    ensure_descriptor_allocator,
    persistent_programs,
    row_config,
    row_width,
    sum_partial_rows,
    tile_rows,
)

# Tuning knobs (module constants so that a GPU sweep, or a test, can patch them).
_MAX_TILE_D = 16384  # widest row held in registers whole; wider rows are chunked
_MAX_TILE_D_BWD = 8192  # same for the backward (x, dy, w live together: at D = 16384 fp32 the
#                         sm_90a build of the one-tile backward used 128 registers and spilled)
_MAX_TILE_D_BWD_FP32 = 4096  # fp32 inputs' backward (FP64_SUMS: fp64 tiles): at 8192 a row alone is
#                              16 elements a thread on 16 warps, which spilled 192 B (sm_90a)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DW_SUM = "kernel"  # "kernel": triton_rows.sum_partial_rows; "torch": partials.sum(0).to(dtype) (the A/B's old form)

# The backward's autotune candidates (`tileport.autotuning`): TILE elements a row tile (BLOCK_M =
# TILE // BLOCK_D rows, at least 1), STAGES the depth of the one-tile loop's software pipeline
# (STAGES - 1 tiles of x and dy in flight), PER_SM persistent programs a streaming multiprocessor:
# as many as are resident at once (a second wave would not overlap the first one's loads), each
# writing one fp32 partial row of the weight gradient (132 rows, 2 MB at D = 4096, against 528).
BWD_OPTIONS = (
    dict(TILE=8192, STAGES=3, PER_SM=1, num_warps=16, num_stages=3),  # fits every D and dtype (the fallback)
    dict(TILE=8192, STAGES=4, PER_SM=1, num_warps=8, num_stages=4),   # the Gluon backward's: 2 rows at 4096 bf16, 96 KB in flight
    dict(TILE=8192, STAGES=4, PER_SM=1, num_warps=16, num_stages=4),  # the same, half the elements a thread
    dict(TILE=4096, STAGES=4, PER_SM=2, num_warps=8, num_stages=4),   # 2 programs an SM: one's row sums under the other's loads
    # fp32 inputs (FP64_SUMS): half the elements a thread, for their fp64 tiles (`candidate_fits`);
    # the first fits every fp32 width (their fallback), both fit 16-bit rows too
    dict(TILE=4096, STAGES=3, PER_SM=1, num_warps=16, num_stages=3),
    dict(TILE=2048, STAGES=4, PER_SM=2, num_warps=8, num_stages=4),
)
INTERPRETER_BWD_OPTIONS = (dict(TILE=1 << 14, STAGES=1, PER_SM=1, num_warps=4, num_stages=1),)
_SHARED_MEMORY_PER_SM = 227 * 1024  # sm_90: at most 227 KB a CTA (228 KB an SM, 1 KB of it reserved a CTA)
_REGISTERS_PER_SM = 65536
_MAX_ELEMS_PER_THREAD = 32  # of a row tile: 32 took 156-190 registers on sm_90a, 16 took 80-107


def shared_bound(option: dict, D: int, element_size: int) -> int:
    """An upper bound on a candidate's shared memory (bytes a CTA) at row width D: STAGES - 1 tiles
    of x and dy in flight, dx's staging tile (TMA store) and up to one tile of scratch for the row
    sums' exchange and layout changes (16 KB seen at D = 1024 bf16); the chunked loops hold one."""
    block_d, one_tile = bwd_row_width(D, element_size)
    in_flight = max(option["STAGES"] - 1, 1) if one_tile else 1
    return (2 * in_flight + 2) * tile_rows(option["TILE"], block_d) * block_d * element_size + 1024


def bwd_row_width(D: int, element_size: int) -> tuple[int, bool]:
    """(BLOCK_D, ONE_TILE) of the backward for row width D and the input's element size."""
    return row_width(D, min(_MAX_TILE_D, _MAX_TILE_D_BWD_FP32 if element_size == 4 else _MAX_TILE_D_BWD))


def candidate_fits(option: dict, D: int, element_size: int) -> bool:
    """Whether PER_SM programs of a candidate are resident on one sm_90 SM at row width D, without
    spills: `shared_bound`, and elements of a row tile a thread as the register budget, 16 where
    the SM's 64K registers are shared by more than 256 threads or the rows are chunked (the chunked
    loops spilled at 32: ptxas stopped at 128 registers), else 32; half that for fp32 inputs,
    whose backward holds fp64 tiles (FP64_SUMS: 16 elements spilled 72-116 B at 128 registers).
    Checked against ptxas for every candidate in tests/test_triton_compile.py."""
    block_d, one_tile = bwd_row_width(D, element_size)
    threads = 32 * option["num_warps"]
    wide = _REGISTERS_PER_SM // (threads * option["PER_SM"]) > 128 and one_tile
    elems = tile_rows(option["TILE"], block_d) * block_d // threads
    budget = (_MAX_ELEMS_PER_THREAD if wide else _MAX_ELEMS_PER_THREAD // 2) // (2 if element_size == 4 else 1)
    return shared_bound(option, D, element_size) * option["PER_SM"] <= _SHARED_MEMORY_PER_SM and elems <= budget


def _prune_to_fitting(configs, named_args, **kwargs):
    """The autotuner's candidates that fit for this call's row width and dtype (at least one: for
    every width and dtype some candidate fits, tests/test_triton_compile.py)."""
    D, size = named_args["D"], named_args["x_ptr"].element_size()
    kept = [c for c in configs if candidate_fits(dict(c.kwargs, num_warps=c.num_warps), D, size)]
    return kept or configs[:1]


def triton_refusal(D: int, dtype, weight_dtype) -> str | None:
    if dtype not in _SUPPORTED_DTYPES:
        return f"x dtype {dtype} is not one of float32, float16, bfloat16"
    if weight_dtype is not None and weight_dtype not in _SUPPORTED_DTYPES:
        return f"weight dtype {weight_dtype} is not one of float32, float16, bfloat16"
    return None


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------


# lint: allow-function TP007 -- the alignment hints are in tileport.triton_rows._load_rows/_store_rows (another module: lint does not follow it)
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, M, D, stride_x, stride_y, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr,
    USE_DESC: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    x_src = _make_rows_desc(x_ptr, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
    y_dst = _make_rows_desc(y_ptr, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    if ONE_TILE:
        x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            y = y * _load_vec(w_ptr, 0, D, BLOCK_D)[None, :]
        _store_rows(y_dst, row0, 0, y, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)
    else:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            ss += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(ss / D + eps)
        for c in range(0, D, BLOCK_D):
            x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            y = x * rstd[:, None]
            if HAS_WEIGHT:
                y = y * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
            _store_rows(y_dst, row0, c, y, M, D, stride_y, BLOCK_M, BLOCK_D, USE_DESC)


@triton.jit
def _add_pair(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _exact_row_products(x, dy, w, HAS_WEIGHT: tl.constexpr):
    """(x^2, g x) with g = dy w, for fp32 tiles x, dy (w: the weight's columns, or None), as fp64
    tiles: every product of two fp32 values exact in fp64 (24-bit significands), g x rounded once."""
    x64 = x.to(tl.float64)
    if HAS_WEIGHT:
        return x64 * x64, (dy.to(tl.float64) * w.to(tl.float64)[None, :]) * x64
    return x64 * x64, dy.to(tl.float64) * x64


@triton.jit
def _exact_dx(x, dy, w, rstd, c, HAS_WEIGHT: tl.constexpr):
    """dx = rstd (g - x c) in fp64 for fp32 tiles x, dy (g = dy w exact) and fp64 row scalars rstd
    and c = rstd^2 sum(g x) / D, rounded once to fp32 (FP64_SUMS)."""
    if HAS_WEIGHT:
        g = dy.to(tl.float64) * w.to(tl.float64)[None, :]
    else:
        g = dy.to(tl.float64)
    return ((g - x.to(tl.float64) * c[:, None]) * rstd[:, None]).to(tl.float32)


@triton.jit
def _weight_chunk(w_ptr, c, D, BLOCK_D: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """The weight's columns [c, c + BLOCK_D), or None without a weight."""
    if HAS_WEIGHT:
        w = _load_vec(w_ptr, c, D, BLOCK_D)
    else:
        w = None
    return w


@triton.autotune(configs=tuned(INTERPRETER_BWD_OPTIONS if interpreter_enabled() else BWD_OPTIONS),
                 key=["D_BUCKET", "HAS_WEIGHT", "WANT_DW", "USE_DESC", "FP64_SUMS"],
                 prune_configs_by={"early_config_prune": _prune_to_fitting})
@triton.jit(do_not_specialize=["D_BUCKET"])
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, dw_part_ptr, M, D, D_BUCKET, stride_x, stride_dy, stride_dx, eps,
    BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr, USE_DESC: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    WANT_DW: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr, PER_SM: tl.constexpr,
    FP64_SUMS: tl.constexpr = False,
):
    """dx = rstd g - x rstd^3 sum(g x) / D (g = dy w, rstd recomputed from x) for the row tiles
    pid, pid + P, ... of x [M, D] (grid (P,), persistent), and with WANT_DW this program's partial
    weight gradient, sum over its rows of dy x rstd, as row pid of dw_part fp32 (the host sums the
    first P rows). D_BUCKET (next power of two of D) is only the autotune key. Explicit here,
    autotuned (`BWD_OPTIONS`): the row tile (TILE elements, TILE // BLOCK_D rows), the persistent
    grid (PER_SM programs an SM) and (ONE_TILE) the depth of the tile loop's software pipeline
    (STAGES); both row sums in one reduction.
    FP64_SUMS (fp32 inputs): dx = rstd (g - x c), c = rstd^2 sum(g x) / D, with g = dy w exact,
    the sums, rstd, c and the difference in fp64, rounded once. Why: where g is nearly parallel to
    x, g and x c cancel to a factor eps / (mean(x^2) + eps) of either, so fp32's roundings of g,
    of the sums and of rstd come back amplified: 2.1e-3 against fp32's 1e-5 bound at |g| / |dx|
    ~ 1e4 (torch's fp32 backward 9.1e-4; docs/perf/llm_ops.md, twentieth session)."""
    BLOCK_M: tl.constexpr = tile_rows(TILE, BLOCK_D)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(M, BLOCK_M)
    x_src = _make_rows_desc(x_ptr, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
    dy_src = _make_rows_desc(dy_ptr, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
    dx_dst = _make_rows_desc(dx_ptr, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
    cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_D), BLOCK_D), BLOCK_D)
    part_row = dw_part_ptr + pid.to(tl.int64) * D
    inv_d = 1.0 / tl.cast(D, tl.float64)  # FP64_SUMS: one fp64 division a program, not one a row (D may be a constexpr 1)
    if ONE_TILE:
        w = _weight_chunk(w_ptr, 0, D, BLOCK_D, HAS_WEIGHT)
        dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        # Triton pipelines a loop without a dot only when the loop asks (on sm_90a the plain range
        # loaded x, waited, then loaded dy, waited: two round trips a tile): STAGES - 1 tiles of x
        # and dy are in flight while one is computed
        for tile in tl.range(pid, num_tiles, nprog, num_stages=STAGES):
            row0 = tile * BLOCK_M
            x = _load_rows(x_src, row0, 0, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
            dy = _load_rows(dy_src, row0, 0, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
            if FP64_SUMS:
                ss, gx = tl.reduce(_exact_row_products(x, dy, w, HAS_WEIGHT), 1, _add_pair)
                rstd64 = tl.math.rsqrt(ss * inv_d + eps)
                dx = _exact_dx(x, dy, w, rstd64, gx * rstd64 * rstd64 * inv_d, HAS_WEIGHT)
                rstd = rstd64.to(tl.float32)
            else:
                if HAS_WEIGHT:
                    g = dy * w[None, :]
                else:
                    g = dy
                # both row sums in one reduction: one exchange across warps instead of two
                ss, gx = tl.reduce((x * x, g * x), 1, _add_pair)
                rstd = tl.rsqrt(ss / D + eps)
                coef = gx * (rstd * rstd * rstd) / D
                dx = g * rstd[:, None] - x * coef[:, None]
            _store_rows(dx_dst, row0, 0, dx, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
            if WANT_DW:
                dw_acc += tl.sum(dy * x * rstd[:, None], axis=0)
        if WANT_DW:
            tl.store(part_row + cols, dw_acc, mask=cols < D)
    else:
        if WANT_DW:
            for c in range(0, D, BLOCK_D):
                tl.store(part_row + c + cols, tl.zeros([BLOCK_D], dtype=tl.float32), mask=c + cols < D)
            tl.debug_barrier()
        for tile in range(pid, num_tiles, nprog):
            row0 = tile * BLOCK_M
            ss = tl.zeros([BLOCK_M], dtype=tl.float64 if FP64_SUMS else tl.float32)
            gx = tl.zeros([BLOCK_M], dtype=tl.float64 if FP64_SUMS else tl.float32)
            for c in range(0, D, BLOCK_D):
                x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
                g = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
                if FP64_SUMS:
                    xx, gxx = _exact_row_products(x, g, _weight_chunk(w_ptr, c, D, BLOCK_D, HAS_WEIGHT), HAS_WEIGHT)
                    ss += tl.sum(xx, axis=1)
                    gx += tl.sum(gxx, axis=1)
                else:
                    if HAS_WEIGHT:
                        g = g * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
                    ss += tl.sum(x * x, axis=1)
                    gx += tl.sum(g * x, axis=1)
            if FP64_SUMS:
                rstd64 = tl.math.rsqrt(ss * inv_d + eps)
                c64 = gx * rstd64 * rstd64 * inv_d
                rstd = rstd64.to(tl.float32)
            else:
                rstd = tl.rsqrt(ss / D + eps)
                coef = gx * (rstd * rstd * rstd) / D
            for c in range(0, D, BLOCK_D):
                x = _load_rows(x_src, row0, c, M, D, stride_x, BLOCK_M, BLOCK_D, USE_DESC)
                dy = _load_rows(dy_src, row0, c, M, D, stride_dy, BLOCK_M, BLOCK_D, USE_DESC)
                if FP64_SUMS:
                    dx = _exact_dx(x, dy, _weight_chunk(w_ptr, c, D, BLOCK_D, HAS_WEIGHT), rstd64, c64, HAS_WEIGHT)
                else:
                    if HAS_WEIGHT:
                        g = dy * _load_vec(w_ptr, c, D, BLOCK_D)[None, :]
                    else:
                        g = dy
                    dx = g * rstd[:, None] - x * coef[:, None]
                _store_rows(dx_dst, row0, c, dx, M, D, stride_dx, BLOCK_M, BLOCK_D, USE_DESC)
                if WANT_DW:
                    pmask = c + cols < D
                    part = tl.load(part_row + c + cols, mask=pmask, other=0.0)
                    tl.store(part_row + c + cols, part + tl.sum(dy * x * rstd[:, None], axis=0), mask=pmask)
            if WANT_DW:
                tl.debug_barrier()  # this tile's partial-row writes before the next tile's reads


# ----------------------------------------------------------------------------------------
# stages (one launch each)
# ----------------------------------------------------------------------------------------



def rms_norm_forward_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y with x's shape and dtype. x [..., D], weight [D] or None."""
    D = x.shape[-1]
    x2 = as_rows(x)
    M = x2.shape[0]
    y = new_empty((M, D), x.dtype, x.device)
    cfg = row_config(M, D, x.device, _MAX_TILE_D)
    use_desc = descriptors_fit([x2, y], x.device)
    if use_desc:
        ensure_descriptor_allocator()
    w = weight.contiguous() if weight is not None else x2
    grid = (cdiv(M, cfg["BLOCK_M"]),)
    _rms_norm_fwd_kernel[grid](
        x2, w, y, M, D, x2.stride(0), y.stride(0), eps,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"], ONE_TILE=cfg["ONE_TILE"],
        USE_DESC=use_desc, HAS_WEIGHT=weight is not None, num_warps=cfg["num_warps"],
    )
    return y.view(x.shape)


def rms_norm_backward_triton(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                             want_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx with x's shape and dtype, d weight in weight's dtype or None)."""
    D = x.shape[-1]
    x2 = as_rows(x)
    dy2 = as_rows(grad_y)
    M = x2.shape[0]
    dx = new_empty((M, D), x.dtype, x.device)
    block_d, one_tile = bwd_row_width(D, x.element_size())
    want_dw = want_dw and weight is not None
    launched = {}

    def grid(meta):
        # the program count follows the candidate (PER_SM, and TILE through the row count); the
        # autotuner calls this for each candidate it times and last for the one it launches
        launched["P"] = persistent_programs(cdiv(M, tile_rows(meta["TILE"], block_d)), x.device, meta["PER_SM"])
        return (launched["P"],)

    # rows enough for any candidate's program count (a program writes only its own row)
    most = persistent_programs(M, x.device, max(c.kwargs["PER_SM"] for c in _rms_norm_bwd_kernel.configs))
    partials = new_empty((most, D), torch.float32, x.device) if want_dw else dx
    use_desc = descriptors_fit([x2, dy2, dx], x.device)
    if use_desc:
        ensure_descriptor_allocator()
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_bwd_kernel[grid](
        x2, w, dy2, dx, partials, M, D, next_pow2(D), x2.stride(0), dy2.stride(0), dx.stride(0), eps,
        BLOCK_D=block_d, ONE_TILE=one_tile, USE_DESC=use_desc, HAS_WEIGHT=weight is not None, WANT_DW=want_dw,
        FP64_SUMS=x.dtype == torch.float32,
    )
    dw = None
    if want_dw:
        part = partials[:launched["P"]]
        if DW_SUM == "torch":
            dw = part.sum(dim=0).to(weight.dtype)
        else:
            dw = sum_partial_rows(part, new_empty((D,), weight.dtype, x.device))
    return dx.view(x.shape), dw
