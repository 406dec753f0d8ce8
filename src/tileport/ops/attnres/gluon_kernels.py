"""AttnRes on Hopper, in Gluon (triton.experimental.gluon, triton 3.6 API): forward and backward.

Math per token row n (fp32), with qw = query * rms_weight and L residual sources r_l:
    rstd_l = 1/sqrt(mean(r_l^2) + eps);  s_l = scale * rstd_l * <r_l, qw>;  p = softmax_l(s)
    o_pre = sum_l p_l r_l;  o = o_pre * rstd_o * ow  (rstd_o the RMS of o_pre) or o = o_pre
Backward (stats recomputed from the inputs; the forward saves nothing):
    do = dy, or with ow: g = dy*ow, do = rstd_o*g - o_pre*rstd_o^3*mean(g*o_pre)
    dp_l = <do, r_l>; ds_l = p_l (dp_l - sum_m p_m dp_m)
    dr_l = p_l do + ds_l*scale*rstd_l*(qw - rstd_l^2 <r_l,qw> r_l / D)
    per program: G rows sum_n sum_l ds_l rstd_l r_l, dow rows sum_n dy*o_pre*rstd_o  (finished on
    the host by `common.finish_parameter_grads`).

How the kernels move data (the part Triton would have chosen for us):
  * Tiles. A tile is one source l over a block of BLOCK_N whole token rows, [BLOCK_N, D]. Each
    residual [N, D] is described to TMA as the row-major view [N*D/BOX, BOX] (BOX = min(D, 256),
    the TMA box limit), so a whole tile is ONE `cp.async.bulk.tensor` of [BLOCK_N*D/BOX, BOX]
    elements into an unswizzled NVMMA buffer, which is byte-for-byte the row-major [BLOCK_N, D]
    tile; the consumer reinterprets it as such. Ragged N: rows past the end come back as zeros.
  * Ring. Tiles go through a STAGES-slot SMEM ring; slot i holds tiles i, i+STAGES, ...; each slot
    has an mbarrier armed with expect-tx bytes; the consumer waits on phase (t // STAGES) & 1. A
    slot is refilled with tile t+STAGES (the next block's tile when t is in the last block
    positions) right after every warp has read tile t (thread_barrier, then TMA). The tile's
    source index is a compile-time value, so the L descriptors are separate kernel arguments
    (triton 3.6's launcher cannot expand descriptors nested in a tuple argument; it can from
    3.7 on) gathered into a tuple in the kernel and indexed inside `gl.static_range`.
  * Residency (constexpr RESIDENT). When the L tiles of a block fit the SMEM budget with room
    to prefetch, they stay resident until the block is done: forward = exact two-sweep softmax
    from SMEM; backward = every pass (stats, o_pre, dp, dr) re-reads SMEM, never HBM or L2.
    Otherwise a streaming ring: forward uses an online softmax (one read of each tile), the
    backward re-loads the tiles by TMA once per pass (they mostly hit L2).
  * Persistent grid of one CTA per SM (forward: 8 warps) or two (backward up to D=4096: 4 warps
    each, half the SMEM each, so one CTA's barriers and reductions hide behind the other's
    work); program pid owns blocks pid, pid+P, ...; the ring prefetches the next block's tiles
    while the current one is computed.
  * Registers. Explicit BlockedLayout, 16-byte vectors along D; each warp owns whole rows when
    D is small enough (row reductions are shuffles, no CTA barrier), else WD warps split a row.
    Backward partial sums of G and dow live in registers across blocks and are written once per
    program as a [P, D] fp32 row. Outputs are written with 16-byte vector stores.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from tileport.memory import new_empty
from tileport.ops.attnres.common import finish_parameter_grads

try:  # the module must import on a CPU machine and without Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton import knobs as _knobs
    from triton.runtime import _allocation

    _GLUON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the installed triton
    _GLUON_ERROR = f"triton.experimental.gluon is unavailable ({type(exc).__name__}: {exc})"

__all__ = [
    "attnres_forward_gluon",
    "attnres_backward_gluon",
    "gluon_refusal",
    "compile_cases",
]

L_MAX = 16  # descriptor arguments r0..r15
D_MAX_BYTES = 8192  # rows up to 8 KB (D=4096 bf16/fp16, 2048 fp32): wider ones spill registers
SMEM_BUDGET = 200 * 1024  # bytes for the TMA rings; the rest of the 227 KB is qw/ow and reduction scratch
SMEM_PER_SM = 228 * 1024  # Hopper: 228 KB per SM, at most 227 KB per CTA (1 KB reserved per CTA)
BOX_MAX = 256  # TMA: at most 256 elements per box dimension
LOG2E = 1.4426950408889634
_DTYPES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}

# Tuning hook for scripts/gluon_attnres_dev.py: {"fwd": {...}, "bwd": {...}} of _make_plan keywords.
_PLAN_OVERRIDES: dict = {}
# Compile without launching (kernel.warmup) - lets the dev script compile every case in parallel.
_WARMUP = False
# Compiled kernels by specialisation key: after the first launch the JIT's binder and cache-key
# work (tens of microseconds with 17 arguments) is skipped and the CompiledKernel is called directly.
_COMPILED: dict = {}


def _launch(kernel, grid, key, runtime: list, consts: dict, num_warps: int):
    """Launch with the runtime arguments (the kernel's leading parameters, in order) and constexprs.

    The first launch of a specialisation goes through the JIT; later ones call the cached
    CompiledKernel with positional arguments, skipping the binder and cache-key work."""
    if _WARMUP:
        kernel.warmup(**dict(zip(kernel.arg_names, runtime)), **consts, grid=grid, num_warps=num_warps)
        return
    hit = _COMPILED.get(key)
    if hit is None or _knobs.runtime.launch_enter_hook is not None:
        kwargs = dict(zip(kernel.arg_names, runtime))
        kwargs.update(consts)
        ck = kernel[grid](**kwargs, num_warps=num_warps)
        if hasattr(ck, "result"):
            ck = ck.result()
        _COMPILED[key] = (ck, [kwargs[name] for name in kernel.arg_names[len(runtime):]])
        return
    ck, tail = hit
    ck[grid](*runtime, *tail)


# --------------------------------------------------------------------------------------------
# Plans: tile shape, register layout and ring depth, all compile-time.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    kind: str  # "fwd" or "bwd"
    num_warps: int
    vec: int  # elements per 16-byte vector
    rpt: int  # rows per thread
    tpw_n: int
    tpw_d: int
    wn: int
    wd: int
    block_n: int  # token rows per tile
    box: int  # TMA box inner size (elements)
    boxr: int  # TMA box rows in the [N*D/box, box] view = block_n * D / box
    tile_bytes: int
    stages: int  # residual ring slots
    dy_stages: int  # backward: dy ring slots
    resident: bool
    ctas_per_sm: int = 1  # persistent grid = ctas_per_sm x #SMs (2: two CTAs share an SM's SMEM)

    def __hash__(self):  # plans key several caches on the launch path: hash once, not per lookup
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f) for f in self.__dataclass_fields__))
            object.__setattr__(self, "_hash", h)
        return h

    def layout(self):
        return _layout(self)

    @property
    def smem_bytes(self) -> int:
        return (self.stages + self.dy_stages) * self.tile_bytes

    def describe(self) -> str:
        mode = "resident" if self.resident else "streaming"
        return (f"{self.kind} {mode}: warps={self.num_warps} (rows x D split {self.wn}x{self.wd}) "
                f"BLOCK_N={self.block_n} tile={self.tile_bytes // 1024}KB stages={self.stages}"
                f"{f' dy_stages={self.dy_stages}' if self.dy_stages else ''} ring={self.smem_bytes // 1024}KB"
                f"{f' ctas/SM={self.ctas_per_sm}' if self.ctas_per_sm > 1 else ''}")


@functools.lru_cache(maxsize=None)
def _layout(plan: Plan):
    return gl.BlockedLayout([plan.rpt, plan.vec], [plan.tpw_n, plan.tpw_d], [plan.wn, plan.wd], [1, 0])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _make_plan(kind: str, L: int, D: int, esize: int, *, num_warps: int | None = None, ept: int | None = None,
               resident: bool | None = None, stages: int | None = None, budget: int | None = None,
               max_stages: int = 32, ctas_per_sm: int | None = None) -> Plan | str:
    """Pick the tile and ring for (L, D, dtype); a string is a refusal reason.

    Defaults (measured on the H200 at L=8, N=16384, D=2048 bf16): the forward runs one 8-warp CTA
    per SM, whole rows per warp, a 6 x 32 KB streaming ring (0.150 ms; 2 CTAs/SM of 4 warps: 0.174,
    resident two-sweep: 0.199); the backward runs two 4-warp CTAs per SM, resident, 20 x 4 KB
    (0.404 ms; one 8-warp CTA: 0.432) - two CTAs hide each other's barrier and reduction latency.
    """
    # backward: two 4-warp CTAs per SM while a row is at most 4 KB; wider rows need 8 warps
    two_ctas = kind == "bwd" and D * esize <= 4096
    if num_warps is None:
        num_warps = 4 if two_ctas else 8
    if ctas_per_sm is None:
        ctas_per_sm = 2 if two_ctas else 1
    vec = 16 // esize
    if budget is None:
        # per-CTA share of the SM's 228 KB, less the fp32 qw/ow vectors and reduction scratch
        cap = SMEM_PER_SM // ctas_per_sm - 1024
        budget = min(SMEM_BUDGET, cap - 2 * D * 4 - 8 * 1024)
    if ept is None:
        # fp32 values per thread for one [BLOCK_N, D] tensor. The forward holds acc and x (whole
        # rows per warp up to D=2048 bf16: no CTA barrier in any reduction); the backward holds
        # more (x, do, the G/dow partials) and ptxas overlaps tiles of the unrolled L loop, so 16.
        # fp32 tiles cost twice the registers of packed 16-bit ones: half the values.
        if kind == "fwd":
            ept = 64 if esize == 2 and D <= 2048 else 32
        else:
            ept = 16 if esize == 2 else 8
    tpw_d = min(32, D // vec)
    tpw_n = 32 // tpw_d
    # very wide rows: let a thread hold more (up to 2x the target, at the price of registers)
    ept = max(ept, min(2 * ept, D // (tpw_d * num_warps)))
    wd = 1
    while wd < num_warps and D // (tpw_d * wd) > ept:
        wd *= 2
    if D // (tpw_d * wd) > ept:
        return f"D={D} is too large for the register budget ({num_warps} warps, {ept} values per thread)"
    wn = num_warps // wd
    epr = D // (tpw_d * wd)  # values per thread per row
    box = min(D, BOX_MAX)
    nb = D // box
    rpt = max(1, ept // epr)
    # the [BLOCK_N, LP] statistics matrices cost rpt*LP registers each (2 in the forward, 5 in the backward)
    rpt = min(rpt, max(1, (32 if kind == "fwd" else 16) // _next_pow2(L)))
    while rpt > 1 and rpt * tpw_n * wn * nb > BOX_MAX:
        rpt //= 2
    block_n = rpt * tpw_n * wn
    if block_n * nb > BOX_MAX:
        return f"D={D}: a {block_n}-row tile needs more than {BOX_MAX} TMA box rows"
    tile = block_n * D * esize
    dy_stages = 2 if kind == "bwd" else 0
    avail = budget - dy_stages * tile
    smax = min(max_stages, avail // tile)
    if smax < 2:
        return f"D={D}: a {tile // 1024} KB tile leaves no room for a 2-stage ring in {budget // 1024} KB of SMEM"
    if resident is None:
        # forward: resident when the block fits with at least L/2 (>= 2) tiles of the next block
        # in flight (else the one-read online softmax streams better); backward: whenever the
        # block fits with 2 slots to spare - its streaming form re-loads every tile per pass
        # and, with the output norm (4 passes), spills a little
        resident = smax >= (L + max(2, L // 2) if kind == "fwd" else L + 2)
    if resident and smax < L + 1:
        return f"L={L} tiles of {tile // 1024} KB do not fit resident with a prefetch slot"
    if stages is None:
        stages = smax
    stages = min(stages, smax)
    if resident:
        stages = max(stages, L + 1)
    return Plan(kind, num_warps, vec, rpt, tpw_n, tpw_d, wn, wd, block_n, box, block_n * nb, tile, stages,
                dy_stages, bool(resident), ctas_per_sm)


@functools.lru_cache(maxsize=None)
def _plan_cached(kind: str, L: int, D: int, esize: int, overrides: tuple) -> Plan | str:
    return _make_plan(kind, L, D, esize, **dict(overrides))


def _overrides_key(kind=None):
    if not _PLAN_OVERRIDES:
        return ()
    if kind is not None:
        return tuple(sorted(_PLAN_OVERRIDES.get(kind, {}).items()))
    return tuple(sorted((k, tuple(sorted(v.items()))) for k, v in _PLAN_OVERRIDES.items()))


def _plan(kind: str, L: int, D: int, esize: int) -> Plan | str:
    return _plan_cached(kind, L, D, esize, _overrides_key(kind))


def gluon_refusal(L: int, D: int, dtype, residuals=None) -> str | None:
    """None if the Gluon kernels take this problem, else a one-line reason."""
    reason = _static_refusal(L, D, dtype, _overrides_key())
    if reason is not None or residuals is None:
        return reason
    dev = residuals[0].get_device()
    for i, r in enumerate(residuals):
        if r.dtype is dtype and r.get_device() == dev and r.data_ptr() & 15 == 0 and r.is_contiguous():
            continue  # the usual case, in one line (this runs on every launch)
        if not r.is_cuda:
            return f"residuals[{i}] is not on a CUDA device"
        if r.get_device() != dev:
            return f"residuals[{i}] is on cuda:{r.get_device()}, residuals[0] on cuda:{dev}"
        if r.dtype != dtype:
            return f"residuals[{i}] has dtype {r.dtype}, expected {dtype}"
        if not r.is_contiguous():
            return f"residuals[{i}] is not contiguous"
        if r.data_ptr() % 16 != 0:
            return f"residuals[{i}].data_ptr() is not 16-byte aligned (TMA)"
    if dev < 0:
        return "residuals are not on a CUDA device"
    major = _capability_major(dev)
    if major != 9:
        return f"the Gluon AttnRes kernels are written for sm_90 (Hopper); this device is sm_{major}x"
    return None


@functools.lru_cache(maxsize=None)
def _static_refusal(L: int, D: int, dtype, overrides_key) -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not supported (bf16, fp16 or fp32)"
    if not 1 <= L <= L_MAX:
        return f"L={L} sources: the Gluon kernels take 1 to {L_MAX}"
    esize = _DTYPES[dtype]
    if D * esize % 16 != 0:
        return f"D={D}: a row of {D * esize} bytes is not a multiple of 16 bytes (TMA)"
    if D & (D - 1) != 0:
        return f"D={D} is not a power of two (Gluon register tiles are power-of-two shaped)"
    if D * esize > D_MAX_BYTES:
        return (f"D={D} ({D * esize} bytes per row) exceeds {D_MAX_BYTES // esize} for {dtype}: "
                f"too large for the SMEM/register budget")
    for kind in ("fwd", "bwd"):
        plan = _plan(kind, L, D, esize)
        if isinstance(plan, str):
            return plan
    return None


@functools.lru_cache(maxsize=None)
def _capability_major(device_index) -> int:
    if device_index is None:
        device_index = torch.cuda.current_device()
    return torch.cuda.get_device_capability(device_index)[0]


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
if _GLUON_ERROR is None:

    @gluon.jit
    def _issue(desc, ring, ready, t, blk, pred, BOXR: gl.constexpr, STAGES: gl.constexpr):
        """TMA tile t (token block blk) into ring slot t % STAGES, armed with its byte count."""
        slot = t % STAGES
        bar = ready.index(slot)
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [blk * BOXR, 0], bar, ring.index(slot), pred=pred)

    @gluon.jit
    def _device_desc(ptr, N, D: gl.constexpr, BOXR: gl.constexpr, BOX: gl.constexpr, LAYOUT: gl.constexpr):
        """The TMA descriptor of a contiguous [N, D] tensor seen as [N*D/BOX, BOX], built on the
        device (in global scratch from triton's allocator) instead of by the host launcher:
        the host then passes a raw pointer, saving the ~10 us per descriptor that encoding a
        CUtensorMap costs on every launch (9 of them per backward)."""
        return tma.make_tensor_descriptor(ptr, [N * (D // BOX), BOX], [BOX, 1], [BOXR, BOX], LAYOUT)

    @gluon.jit
    def _read(ring, t, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, BL: gl.constexpr):
        """Slot of tile t as the row-major [BLOCK_N, D] tile it is, loaded in layout BL, fp32."""
        view = ring.index(t % STAGES)._reinterpret(ring.dtype, [BLOCK_N, D],
                                                   gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        return view.load(BL).to(gl.float32)

    @gluon.jit
    def _wait_read(ring, ready, t, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                   BL: gl.constexpr):
        mbarrier.wait(ready.index(t % STAGES), (t // STAGES) & 1)
        return _read(ring, t, STAGES, BLOCK_N, D, BL)

    @gluon.jit
    def _refill(descs, ring, ready, t, k, my_blocks, pid, P, POS: gl.constexpr, TPB: gl.constexpr,
                L: gl.constexpr, BOXR: gl.constexpr, STAGES: gl.constexpr):
        """Every warp is done with tile t (position POS of this program's block k, TPB tiles per
        block): reuse its slot for tile t + STAGES, whose block and source are known statically."""
        gl.thread_barrier()
        kn = k + (POS + STAGES) // TPB
        _issue(descs[((POS + STAGES) % TPB) % L], ring, ready, t + STAGES, pid + kn * P, kn < my_blocks,
               BOXR, STAGES)

    @gluon.jit
    def _add2(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    @gluon.jit
    def _add3(a0, b0, c0, a1, b1, c1):
        return a0 + a1, b0 + b1, c0 + c1

    @gluon.jit
    def _col(M, lcol, l: gl.constexpr):
        """Column l of a [BLOCK_N, LP] statistics matrix, as a per-row vector."""
        return gl.sum(gl.where(lcol[None, :] == l, M, 0.0), axis=1)

    @gluon.jit(do_not_specialize=["N"])
    def _attnres_fwd_kernel(
        r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15,
        o_ptr, p_ptr, q_ptr, w_ptr, ow_ptr,
        N, eps, scale_log2,
        L: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, BOXR: gl.constexpr,
        STAGES: gl.constexpr, LP: gl.constexpr, RESIDENT: gl.constexpr, HAS_OW: gl.constexpr,
        STORE_P: gl.constexpr, BL: gl.constexpr,
        DEVICE_DESC: gl.constexpr, BOX: gl.constexpr, DESC_LAYOUT: gl.constexpr,
    ):
        """AttnRes forward: o [N, D] (and p [L, N] fp32 when STORE_P) from L residual descriptors.

        Grid: persistent, P = min(#blocks, #SMs) programs; program pid does token blocks pid, pid+P, ...
        Explicit here (Triton would choose): the TMA descriptors and one-box-per-tile shape, the
        STAGES-deep mbarrier ring and its phases, prefetch across blocks, residency (RESIDENT:
        exact softmax over the resident tiles; else online softmax, each tile read once), the
        register layout BL (whole rows per warp, 16-byte vectors) and the vector stores.
        r0..r15 are host TMA descriptors, or (DEVICE_DESC) raw pointers the kernel builds them from.
        """
        descs = (r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15)
        if DEVICE_DESC:  # (a tuple holding the unused Nones can't be passed to a helper)
            ptrs = descs
            descs = ()
            for l in gl.static_range(L):
                descs = descs + (_device_desc(ptrs[l], N, D, BOXR, BOX, DESC_LAYOUT),)
        ROWS: gl.constexpr = gl.SliceLayout(1, BL)
        COLS: gl.constexpr = gl.SliceLayout(0, BL)
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        my_blocks = (gl.cdiv(N, BLOCK_N) - pid + P - 1) // P

        cols = gl.arange(0, D, layout=COLS)
        lcol = gl.arange(0, LP, layout=COLS)
        # qw (fp32) lives in SMEM, read per tile: holding it in registers next to acc and x spills
        NVEC: gl.constexpr = 2 if HAS_OW else 1
        vecs = gl.allocate_shared_memory(gl.float32, [NVEC, D], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        vecs.index(0).store(gl.load(q_ptr + cols).to(gl.float32) * gl.load(w_ptr + cols).to(gl.float32))
        if HAS_OW:
            vecs.index(1).store(gl.load(ow_ptr + cols).to(gl.float32))

        d0 = descs[0]
        ring = gl.allocate_shared_memory(d0.dtype, [STAGES, BOXR, d0.block_type.shape[1]], d0.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()
        for i in gl.static_range(STAGES):  # prologue: the first STAGES tiles of this program
            _issue(descs[i % L], ring, ready, i, pid + (i // L) * P, (i // L) < my_blocks, BOXR, STAGES)

        for k in range(my_blocks):
            rows = (pid + k * P) * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROWS)
            S = gl.full([BLOCK_N, LP], float("-inf"), gl.float32, BL)
            if RESIDENT:
                # sweep 1: logits of every source, from the resident tiles
                for l in gl.static_range(L):
                    x = _wait_read(ring, ready, k * L + l, STAGES, BLOCK_N, D, BL)
                    qw = vecs.index(0).load(COLS)
                    ss, dt = gl.reduce((x * x, x * qw[None, :]), 1, _add2)  # one reduction for both
                    s = gl.rsqrt(ss * (1.0 / D) + eps) * dt * scale_log2
                    S = gl.where(lcol[None, :] == l, s[:, None], S)
                m = gl.max(S, axis=1)
                e = gl.exp2(S - m[:, None])
                pm = e * (1.0 / gl.sum(e, axis=1))[:, None]
                # sweep 2: o = sum_l p_l r_l from the same tiles, each slot refilled after its last read.
                # The barrier also stops LLVM from keeping sweep 1's loads alive in registers (spills).
                gl.thread_barrier()
                acc = gl.zeros([BLOCK_N, D], gl.float32, BL)
                for l in gl.static_range(L):
                    x = _read(ring, k * L + l, STAGES, BLOCK_N, D, BL)
                    acc += _col(pm, lcol, l)[:, None] * x
                    _refill(descs, ring, ready, k * L + l, k, my_blocks, pid, P, l, L, L, BOXR, STAGES)
            else:
                for l in gl.static_range(L):
                    x = _wait_read(ring, ready, k * L + l, STAGES, BLOCK_N, D, BL)
                    _refill(descs, ring, ready, k * L + l, k, my_blocks, pid, P, l, L, L, BOXR, STAGES)
                    qw = vecs.index(0).load(COLS)
                    ss, dt = gl.reduce((x * x, x * qw[None, :]), 1, _add2)  # one reduction for both
                    s = gl.rsqrt(ss * (1.0 / D) + eps) * dt * scale_log2
                    S = gl.where(lcol[None, :] == l, s[:, None], S)
                    if l == 0:
                        m = s
                        lsum = gl.full([BLOCK_N], 1.0, gl.float32, ROWS)
                        acc = x
                    else:
                        m_new = gl.maximum(m, s)
                        alpha = gl.exp2(m - m_new)
                        e_l = gl.exp2(s - m_new)
                        lsum = lsum * alpha + e_l
                        acc = acc * alpha[:, None] + e_l[:, None] * x
                        m = m_new
                inv = 1.0 / lsum
                acc = acc * inv[:, None]
                pm = gl.exp2(S - m[:, None]) * inv[:, None]

            if HAS_OW:
                ow = vecs.index(1).load(COLS)
                rstd_o = gl.rsqrt(gl.sum(acc * acc, axis=1) * (1.0 / D) + eps)
                acc = acc * rstd_o[:, None] * ow[None, :]
            row_ok = rows < N
            offs = rows.to(gl.int64)[:, None] * D + cols[None, :]
            # lint: allow TP001 -- 16-byte vector stores straight from registers: a TMA store would need SMEM staging the ring already uses
            gl.store(o_ptr + offs, acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
            if STORE_P:
                poffs = lcol[None, :] * N + rows[:, None]
                # lint: allow TP001 -- the optional [L, N] fp32 weights: a transposed scatter of L values per row, too small for TMA
                gl.store(p_ptr + poffs, pm, mask=(lcol[None, :] < L) & row_ok[:, None])

        gl.thread_barrier()
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

    @gluon.jit(do_not_specialize=["N"])
    def _attnres_bwd_kernel(
        r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15, dy_desc,
        dr_ptr, g_part_ptr, w_part_ptr, q_ptr, w_ptr, ow_ptr,
        N, eps, scale, scale_log2,
        L: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, BOXR: gl.constexpr,
        STAGES: gl.constexpr, DY_STAGES: gl.constexpr, LP: gl.constexpr, RESIDENT: gl.constexpr,
        HAS_OW: gl.constexpr, BL: gl.constexpr,
        DEVICE_DESC: gl.constexpr, BOX: gl.constexpr, DESC_LAYOUT: gl.constexpr,
    ):
        """AttnRes backward: dr [L, N, D], G partial rows [P, D] and (HAS_OW) dow partial rows [P, D].

        Grid: persistent, P = min(#blocks, #SMs); program pid does token blocks pid, pid+P, ...
        Passes per block: A (rstd, <r,qw>, and without ow <dy,r>) -> softmax; with ow also
        B (o_pre -> rstd_o, do, dow) and C (<do,r>); then D (dr_l, G). RESIDENT: the L tiles stay
        in SMEM and every pass reads them there; else each pass re-loads them through the ring.
        dy has its own DY_STAGES-slot TMA ring, read from SMEM where needed (not held in registers).
        Explicit here (Triton would choose): descriptors, rings, mbarrier phases, residency, the
        cross-block prefetch, the register layout BL, and the G/dow partials that stay in
        registers until one row per program is written. r0..r15 and dy_desc are host TMA
        descriptors, or (DEVICE_DESC) raw pointers the kernel builds them from.
        """
        descs = (r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15)
        if DEVICE_DESC:  # (a tuple holding the unused Nones can't be passed to a helper)
            ptrs = descs
            descs = ()
            for l in gl.static_range(L):
                descs = descs + (_device_desc(ptrs[l], N, D, BOXR, BOX, DESC_LAYOUT),)
        if DEVICE_DESC:
            dyd = _device_desc(dy_desc, N, D, BOXR, BOX, DESC_LAYOUT)
        else:
            dyd = dy_desc
        ROWS: gl.constexpr = gl.SliceLayout(1, BL)
        COLS: gl.constexpr = gl.SliceLayout(0, BL)
        NPASS: gl.constexpr = 4 if HAS_OW else 2
        TPB: gl.constexpr = L if RESIDENT else NPASS * L  # ring tiles per block
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        my_blocks = (gl.cdiv(N, BLOCK_N) - pid + P - 1) // P

        cols = gl.arange(0, D, layout=COLS)
        lcol = gl.arange(0, LP, layout=COLS)
        # qw and ow (fp32) live in SMEM and are read where used, to leave registers to the tiles
        NVEC: gl.constexpr = 2 if HAS_OW else 1
        vecs = gl.allocate_shared_memory(gl.float32, [NVEC, D], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        vecs.index(0).store(gl.load(q_ptr + cols).to(gl.float32) * gl.load(w_ptr + cols).to(gl.float32))
        if HAS_OW:
            vecs.index(1).store(gl.load(ow_ptr + cols).to(gl.float32))

        d0 = descs[0]
        ring = gl.allocate_shared_memory(d0.dtype, [STAGES, BOXR, d0.block_type.shape[1]], d0.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dy_ring = gl.allocate_shared_memory(dyd.dtype, [DY_STAGES, BOXR, dyd.block_type.shape[1]], dyd.layout)
        dy_ready = gl.allocate_shared_memory(gl.int64, [DY_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(DY_STAGES):
            mbarrier.init(dy_ready.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()
        for i in gl.static_range(DY_STAGES):
            _issue(dyd, dy_ring, dy_ready, i, pid + i * P, i < my_blocks, BOXR, DY_STAGES)
        for i in gl.static_range(STAGES):
            _issue(descs[(i % TPB) % L], ring, ready, i, pid + (i // TPB) * P, (i // TPB) < my_blocks,
                   BOXR, STAGES)

        g_acc = gl.zeros([BLOCK_N, D], gl.float32, BL)
        if HAS_OW:
            w_acc = gl.zeros([BLOCK_N, D], gl.float32, BL)

        for k in range(my_blocks):
            rows = (pid + k * P) * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROWS)
            t0 = k * TPB
            mbarrier.wait(dy_ready.index(k % DY_STAGES), (k // DY_STAGES) & 1)
            if not HAS_OW:
                dy = _read(dy_ring, k, DY_STAGES, BLOCK_N, D, BL)
            R = gl.zeros([BLOCK_N, LP], gl.float32, BL)  # rstd_l
            T = gl.zeros([BLOCK_N, LP], gl.float32, BL)  # <r_l, qw>
            DP = gl.zeros([BLOCK_N, LP], gl.float32, BL)  # <do, r_l>
            # pass A
            for l in gl.static_range(L):
                x = _wait_read(ring, ready, t0 + l, STAGES, BLOCK_N, D, BL)
                if not RESIDENT:
                    _refill(descs, ring, ready, t0 + l, k, my_blocks, pid, P, l, TPB, L, BOXR, STAGES)
                qw = vecs.index(0).load(COLS)
                # one (multi-operand) reduction per tile: when WD > 1 warps share a row, each
                # reduction costs a CTA barrier round trip through SMEM scratch
                if HAS_OW:
                    ss, dt = gl.reduce((x * x, x * qw[None, :]), 1, _add2)
                else:
                    ss, dt, dp = gl.reduce((x * x, x * qw[None, :], x * dy), 1, _add3)
                    DP = gl.where(lcol[None, :] == l, dp[:, None], DP)
                R = gl.where(lcol[None, :] == l, gl.rsqrt(ss * (1.0 / D) + eps)[:, None], R)
                T = gl.where(lcol[None, :] == l, dt[:, None], T)
            S = gl.where(lcol[None, :] < L, R * T * scale_log2, float("-inf"))
            m = gl.max(S, axis=1)
            e = gl.exp2(S - m[:, None])
            pm = e * (1.0 / gl.sum(e, axis=1))[:, None]

            if HAS_OW:
                # pass B: o_pre -> rstd_o, do, dow contribution
                if RESIDENT:
                    gl.thread_barrier()  # re-read SMEM: keeps LLVM from holding pass A's tiles in registers
                o_pre = gl.zeros([BLOCK_N, D], gl.float32, BL)
                for l in gl.static_range(L):
                    if RESIDENT:
                        x = _read(ring, t0 + l, STAGES, BLOCK_N, D, BL)
                    else:
                        x = _wait_read(ring, ready, t0 + L + l, STAGES, BLOCK_N, D, BL)
                        _refill(descs, ring, ready, t0 + L + l, k, my_blocks, pid, P, L + l, TPB, L, BOXR, STAGES)
                    o_pre += _col(pm, lcol, l)[:, None] * x
                dy = _read(dy_ring, k, DY_STAGES, BLOCK_N, D, BL)
                g = dy * vecs.index(1).load(COLS)[None, :]
                ss_o, go = gl.reduce((o_pre * o_pre, g * o_pre), 1, _add2)
                rstd_o = gl.rsqrt(ss_o * (1.0 / D) + eps)
                w_acc += dy * o_pre * rstd_o[:, None]
                c = rstd_o * rstd_o * rstd_o * go * (1.0 / D)
                do = rstd_o[:, None] * g - c[:, None] * o_pre
                # pass C: dp_l = <do, r_l>
                if RESIDENT:
                    gl.thread_barrier()
                for l in gl.static_range(L):
                    if RESIDENT:
                        x = _read(ring, t0 + l, STAGES, BLOCK_N, D, BL)
                    else:
                        x = _wait_read(ring, ready, t0 + 2 * L + l, STAGES, BLOCK_N, D, BL)
                        _refill(descs, ring, ready, t0 + 2 * L + l, k, my_blocks, pid, P, 2 * L + l, TPB, L,
                                BOXR, STAGES)
                    DP = gl.where(lcol[None, :] == l, gl.sum(x * do, axis=1)[:, None], DP)
            else:
                do = _read(dy_ring, k, DY_STAGES, BLOCK_N, D, BL)

            delta = gl.sum(pm * DP, axis=1)
            DS = pm * (DP - delta[:, None])
            row_ok = rows < N
            offs = rows.to(gl.int64)[:, None] * D + cols[None, :]
            # pass D: dr_l and the G partial
            if RESIDENT:
                gl.thread_barrier()
            for l in gl.static_range(L):
                if RESIDENT:
                    x = _read(ring, t0 + l, STAGES, BLOCK_N, D, BL)
                else:
                    x = _wait_read(ring, ready, t0 + (NPASS - 1) * L + l, STAGES, BLOCK_N, D, BL)
                    _refill(descs, ring, ready, t0 + (NPASS - 1) * L + l, k, my_blocks, pid, P,
                            (NPASS - 1) * L + l, TPB, L, BOXR, STAGES)
                rstd = _col(R, lcol, l)
                ds = _col(DS, lcol, l)
                cq = ds * rstd * scale
                cx = -cq * rstd * rstd * _col(T, lcol, l) * (1.0 / D)
                qw = vecs.index(0).load(COLS)
                dr = _col(pm, lcol, l)[:, None] * do + cq[:, None] * qw[None, :] + cx[:, None] * x
                # lint: allow TP001 -- 16-byte vector stores straight from registers: a TMA store would need SMEM staging the ring already uses
                gl.store(dr_ptr + (N * l).to(gl.int64) * D + offs, dr.to(dr_ptr.dtype.element_ty),
                         mask=row_ok[:, None])
                g_acc += (ds * rstd)[:, None] * x
                if RESIDENT:
                    _refill(descs, ring, ready, t0 + l, k, my_blocks, pid, P, l, TPB, L, BOXR, STAGES)
            # dy slot of block k is free (its last read was before pass D's barriers): prefetch block k+DY_STAGES
            gl.thread_barrier()
            kn = k + DY_STAGES
            _issue(dyd, dy_ring, dy_ready, kn, pid + kn * P, kn < my_blocks, BOXR, DY_STAGES)

        gl.store(g_part_ptr + pid * D + cols, gl.sum(g_acc, axis=0))
        if HAS_OW:
            gl.store(w_part_ptr + pid * D + cols, gl.sum(w_acc, axis=0))
        gl.thread_barrier()
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        for i in gl.static_range(DY_STAGES):
            mbarrier.invalidate(dy_ready.index(i))


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def _smem_layout(esize: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * esize, rank=2)


@functools.lru_cache(maxsize=None)
def _desc_consts(plan: Plan, D: int, esize: int):
    return [plan.box, 1], [plan.boxr, plan.box], _smem_layout(esize), D // plan.box


def _descriptors(tensors, N: int, D: int, plan: Plan, esize: int) -> list:
    """TMA descriptors of contiguous [N, D] tensors, each seen as [N*D/box, box]; one box = one tile.

    Built without TensorDescriptor.__post_init__ (about 7 us each, 9 per backward launch): the
    alignment, strides and block shape it would check are guaranteed by gluon_refusal and the plan."""
    strides, block, layout, nb = _desc_consts(plan, D, esize)
    shape = [N * nb, plan.box]
    out = []
    for t in tensors:
        d = TensorDescriptor.__new__(TensorDescriptor)
        d.base = t
        d.shape = shape
        d.strides = strides
        d.block_shape = block
        d.layout = layout
        d.padding = "zero"
        out.append(d)
    return out


def _fwd_runtime(descs, o, p, q, w, ow, N, eps, scale) -> list:
    """The forward kernel's non-constexpr parameters, in signature order."""
    return [*descs, *([None] * (L_MAX - len(descs))), o, p, q, w, ow, N, float(eps), float(scale) * LOG2E]


def _desc_consts_kw(plan: Plan, device_desc: bool) -> dict:
    return dict(DEVICE_DESC=device_desc, BOX=plan.box, DESC_LAYOUT=_smem_layout(16 // plan.vec))


@functools.lru_cache(maxsize=None)
def _fwd_consts(plan: Plan, L: int, D: int, has_ow: bool, store_p: bool, device_desc: bool = False) -> dict:
    return dict(L=L, D=D, BLOCK_N=plan.block_n, BOXR=plan.boxr, STAGES=plan.stages, LP=_next_pow2(L),
                RESIDENT=plan.resident, HAS_OW=has_ow, STORE_P=store_p, BL=plan.layout(),
                **_desc_consts_kw(plan, device_desc))


def _bwd_runtime(descs, dy_desc, dr, g_part, w_part, q, w, ow, N, eps, scale) -> list:
    """The backward kernel's non-constexpr parameters, in signature order."""
    return [*descs, *([None] * (L_MAX - len(descs))), dy_desc, dr, g_part, w_part, q, w, ow, N, float(eps),
            float(scale), float(scale) * LOG2E]


@functools.lru_cache(maxsize=None)
def _bwd_consts(plan: Plan, L: int, D: int, has_ow: bool, device_desc: bool = False) -> dict:
    return dict(L=L, D=D, BLOCK_N=plan.block_n, BOXR=plan.boxr, STAGES=plan.stages, DY_STAGES=plan.dy_stages,
                LP=_next_pow2(L), RESIDENT=plan.resident, HAS_OW=has_ow, BL=plan.layout(),
                **_desc_consts_kw(plan, device_desc))


def _fwd_args(plan: Plan, descs, o, p, q, w, ow, N, L, D, eps, scale, device_desc: bool = False) -> dict:
    args = dict(zip(_attnres_fwd_kernel.arg_names, _fwd_runtime(descs, o, p, q, w, ow, N, eps, scale)))
    args.update(_fwd_consts(plan, L, D, ow is not None, p is not None, device_desc))
    return args


def _bwd_args(plan: Plan, descs, dy_desc, dr, g_part, w_part, q, w, ow, N, L, D, eps, scale,
              device_desc: bool = False) -> dict:
    runtime = _bwd_runtime(descs, dy_desc, dr, g_part, w_part, q, w, ow, N, eps, scale)
    args = dict(zip(_attnres_bwd_kernel.arg_names, runtime))
    args.update(_bwd_consts(plan, L, D, ow is not None, device_desc))
    return args


def _device_descriptors() -> bool:
    """TILEPORT_ATTNRES_DESC=device: the kernels build their TMA descriptors on the device (see
    `_device_desc`); the default, host, has the launcher encode them. Device-side descriptors
    compile and pass the CPU checks but have not yet run on the H200 (2026-11-29): the default
    flips once the GPU gate and the benchmark have seen them."""
    return os.environ.get("TILEPORT_ATTNRES_DESC", "host") == "device"


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side descriptors live in global scratch that the launcher asks triton's allocator
    for. The allocator is a ContextVar, so a thread that never set one (autograd's backward
    thread included) has the null allocator: install torch's caching allocator there, and never
    replace one the user set."""
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        _allocation._allocator.set(_scratch)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(N: int, plan: Plan, device) -> int:
    n_blocks = -(-N // plan.block_n)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(n_blocks, plan.ctas_per_sm * _num_sms(idx)))


def _vec_key(*vs):
    """What the JIT specialises the [D] parameter pointers on: dtype and 16-byte alignment."""
    return tuple(None if v is None else (v.dtype, v.data_ptr() % 16 == 0) for v in vs)


def _checked_plan(kind, L, D, dtype, residuals) -> Plan:
    reason = gluon_refusal(L, D, dtype, residuals)
    if reason is not None:
        raise ValueError(f"attnres gluon: {reason}")
    plan = _plan(kind, L, D, _DTYPES[dtype])
    assert isinstance(plan, Plan)
    return plan


def attnres_forward_gluon(query, residuals, rms_weight, output_rms_weight, eps: float, scale: float,
                          return_weights: bool):
    """o [N, D] in the residual dtype and p [L, N] fp32 (or None), on the Hopper Gluon path."""
    residuals = tuple(residuals)
    L = len(residuals)
    N, D = residuals[0].shape
    dtype, dev = residuals[0].dtype, residuals[0].device
    plan = _checked_plan("fwd", L, D, dtype, residuals)
    o = new_empty((N, D), dtype, dev)
    p = new_empty((L, N), torch.float32, dev) if return_weights else None
    if N == 0:
        return o, p
    esize = _DTYPES[dtype]
    device_desc = _device_descriptors()
    if device_desc:
        _ensure_allocator()
        descs = residuals
    else:
        descs = _descriptors(residuals, N, D, plan, esize)
    runtime = _fwd_runtime(descs, o, p, query, rms_weight, output_rms_weight, N, eps, scale)
    consts = _fwd_consts(plan, L, D, output_rms_weight is not None, p is not None, device_desc)
    key = ("fwd", plan, L, D, dtype, p is not None, dev.index, N >= 2**31, device_desc) + _vec_key(
        query, rms_weight, output_rms_weight)
    _launch(_attnres_fwd_kernel, (_grid(N, plan, dev),), key, runtime, consts, plan.num_warps)
    return o, p


def attnres_backward_gluon(grad_o, query, residuals, rms_weight, output_rms_weight, eps, scale):
    """(grad_residuals [L x [N, D]], grad_query, grad_rms_weight, grad_output_rms_weight or None)."""
    residuals = tuple(residuals)
    L = len(residuals)
    N, D = residuals[0].shape
    dtype, dev = residuals[0].dtype, residuals[0].device
    plan = _checked_plan("bwd", L, D, dtype, residuals)
    if grad_o.dtype != dtype or not grad_o.is_contiguous() or grad_o.data_ptr() % 16 != 0:
        grad_o = grad_o.to(dtype).contiguous()
    dr = new_empty((L, N, D), dtype, dev)
    P = _grid(N, plan, dev) if N > 0 else 0
    g_part = new_empty((P, D), torch.float32, dev)
    w_part = new_empty((P, D), torch.float32, dev) if output_rms_weight is not None else None
    if N > 0:
        esize = _DTYPES[dtype]
        device_desc = _device_descriptors()
        if device_desc:
            _ensure_allocator()
            descs, dy_desc = residuals, grad_o
        else:
            *descs, dy_desc = _descriptors(residuals + (grad_o,), N, D, plan, esize)
        runtime = _bwd_runtime(descs, dy_desc, dr, g_part, w_part, query, rms_weight, output_rms_weight, N, eps,
                               scale)
        consts = _bwd_consts(plan, L, D, output_rms_weight is not None, device_desc)
        key = ("bwd", plan, L, D, dtype, dev.index, N >= 2**31, device_desc) + _vec_key(
            query, rms_weight, output_rms_weight)
        _launch(_attnres_bwd_kernel, (P,), key, runtime, consts, plan.num_warps)
    grad_q, grad_w, grad_ow = finish_parameter_grads(g_part, w_part, query, rms_weight, output_rms_weight, scale)
    return [dr[i] for i in range(L)], grad_q, grad_w, grad_ow


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def _case(kind: str, L: int, D: int, dtype, has_ow: bool, N: int = 16384, max_spills: int = 0,
          device_desc: bool = False, **plan_kw):
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    esize = _DTYPES[dtype]
    plan = _make_plan(kind, L, D, esize, **plan_kw)
    if isinstance(plan, str):
        raise ValueError(plan)
    nb = D // plan.box

    def desc():
        if device_desc:  # the kernel builds the descriptor from the tensor's pointer
            return TensorStandIn([N, D], dtype)
        return descriptor_stand_in([N * nb, plan.box], dtype, [plan.boxr, plan.box], _smem_layout(esize))

    vec = TensorStandIn([D], dtype)
    ow = TensorStandIn([D], dtype) if has_ow else None
    descs = [desc() for _ in range(L)]
    if kind == "fwd":
        args = _fwd_args(plan, descs, TensorStandIn([N, D], dtype), TensorStandIn([L, N], torch.float32), vec, vec,
                         ow, N, L, D, 1e-6, 1.0, device_desc)
        kernel = _attnres_fwd_kernel
    else:
        P = 132
        args = _bwd_args(plan, descs, desc(), TensorStandIn([L, N, D], dtype), TensorStandIn([P, D], torch.float32),
                         TensorStandIn([P, D], torch.float32) if has_ow else None, vec, vec, ow, N, L, D, 1e-6, 1.0,
                         device_desc)
        kernel = _attnres_bwd_kernel
    name = (f"attnres_{kind}_{'resident' if plan.resident else 'streaming'}_L{L}_D{D}_"
            f"{str(dtype).split('.')[-1]}{'_ow' if has_ow else ''}{'_devdesc' if device_desc else ''}")
    expect = ["cp.async.bulk.tensor", "mbarrier.try_wait", "mbarrier.arrive.expect_tx", "st.global.v4"]
    if device_desc:  # the descriptor written on the device and fenced before TMA uses it
        expect += ["tensormap.replace", "fence.proxy.tensormap"]
    return CompileCase(name=name, kernel=kernel, args=args, num_warps=plan.num_warps,
                       expect_ptx=expect,
                       expect_max_spills=max_spills,
                       # ctas_per_sm CTAs must fit one SM's shared memory together
                       expect_max_shared=SMEM_PER_SM // plan.ctas_per_sm - 1024)


def compile_cases():
    """Every kernel in its main configurations: L=8, D=2048 bf16 (the benchmark shape), forward
    streaming (its default there) and resident, backward resident (its default there) and
    streaming, each with and without the output norm; plus a small-D fp32 pair and the widest
    rows (D=4096 bf16)."""
    if _GLUON_ERROR is not None:
        return []
    cases = []
    for has_ow in (False, True):
        cases.append(_case("fwd", 8, 2048, torch.bfloat16, has_ow))
        cases.append(_case("fwd", 8, 2048, torch.bfloat16, has_ow, resident=True, ept=32))
        cases.append(_case("bwd", 8, 2048, torch.bfloat16, has_ow))
        # the streaming backward is the fallback when L tiles do not fit resident; with the output
        # norm (4 passes, 32 ring tiles per block unrolled) ptxas spills a little (72 bytes in 3.6.0)
        cases.append(_case("bwd", 8, 2048, torch.bfloat16, has_ow, resident=False, max_spills=128 if has_ow else 0))
    cases.append(_case("fwd", 3, 64, torch.float32, True, N=1000))
    cases.append(_case("bwd", 3, 64, torch.float32, True, N=1000))
    cases.append(_case("fwd", 8, 4096, torch.bfloat16, True))  # the widest rows: 8 warps split each row
    cases.append(_case("bwd", 8, 4096, torch.bfloat16, True))
    # device-side descriptors (TILEPORT_ATTNRES_DESC=device) at the benchmark shape
    cases.append(_case("fwd", 8, 2048, torch.bfloat16, False, device_desc=True))
    cases.append(_case("bwd", 8, 2048, torch.bfloat16, False, device_desc=True))
    return cases
