"""Kimi Delta Attention, Gluon backend for Hopper (sm_90): the forward's output (stage 6) for the
chunks that take the whole-chunk form, on TMA and WGMMA.

The backend "gluon" is the Triton backend (tileport.ops.kda.triton_kernels) with stage 6's
whole-chunk launch replaced by a Gluon kernel. Stage 3 flags each chunk whose per-channel gates
span more than 60 about its middle row (DIAGONAL_FORM "chunk"); those chunks keep Triton's
16-row sub-block kernel (`triton_kernels.output_flagged_chunks`), every other chunk is one program
of `_kda_output_wgmma_kernel` here (two per SM: 96 KB of shared memory at K = V = 128). H200 at
151d1b4 (scripts/kda_ab.py "gluon", S1, logsigmoid gates): the whole forward 1.559 ms against
Triton's 1.998, the kernel ~0.34 ms per forward against ~0.78 for Triton's whole-chunk launch
(torch profiler); a persistent form with two TMA buffer sets, one program per SM, took ~0.47 (1.699
ms forward) and was removed (docs/perf/kda.md row 14). The backward is Triton's
(`kda_backward_triton`) with its two state recurrences on GDN's `_tf32_recurrence_kernel` in
its PER_CHANNEL form (docs/perf/kda.md row 17).

Per chunk, with d = G - G_m (m the chunk's middle row, fp32) and factors that are finite where the
chunk is not flagged (|d| <= 60):
    P = lower((Q * exp(d)) (K * exp(-d))^T)          one [64, K] x [K, 64] bf16 WGMMA
    O = scale ((Q * exp(d + G_m)) h_c + P Vn)        two more, onto one fp32 accumulator
the same operands, roundings and masks as Triton's `_kda_output_chunk`, so the two agree to the
order of the fp32 accumulation.

bf16 only, K = V of 64 or 128 (GDN's Gluon kernels' shapes): fp16 inputs take bf16 products in
Triton's kernels (gate products underflow fp16) and fp32 inputs the exact block kernels.
"""

from __future__ import annotations

import torch

from tileport.memory import new_empty
from tileport.ops.gdn.gluon_kernels import (SMEM_PER_SM, _GLUON_ERROR, _smem_layout, chunk_dstates_gluon,
                                            chunk_states_recompute_gluon, chunk_tile_descriptors)
from tileport.ops.kda import triton_kernels as kk

if _GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

    from tileport.ops.gdn.gluon_kernels import _chunk_bounds, _issue_chunk_tiles

BT = 64  # the chunk: M of every WGMMA here, one warpgroup of 4 warps
HEAD_DIMS = (64, 128)

__all__ = ["gluon_refusal", "kda_forward_gluon", "kda_backward_gluon", "compile_cases"]


def gluon_refusal(K: int, V: int, dtype: torch.dtype) -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if dtype != torch.bfloat16:
        return f"{dtype}: the Gluon KDA kernel takes bfloat16 only (fp16 needs bf16 operands, fp32 exact products)"
    if K not in HEAD_DIMS or K != V:
        return f"K={K}, V={V}: the Gluon KDA kernel takes K == V of {HEAD_DIMS}"
    return None


if _GLUON_ERROR is None:

    @gluon.jit
    def _kda_chunk_output(q_b, k_b, vn_b, h_b, kd_b, G_ptr, o_ptr, chunks_ptr, item, H, scale,
                          K: gl.constexpr, V: gl.constexpr):
        """O of work item `item` = c * H + hh (chunk c, head hh) from its q, k, Vn and h tiles,
        already in shared memory: the gate factors are applied in registers (Q's on the way to two
        register A operands, K's on the way to kd_b, the B operand of P's product, which TMA cannot
        give scaled); P masked to its lower triangle and the sequence's rows, then handed to the
        last WGMMA from registers; O stored with a row mask (a varlen chunk's tail rows belong to
        the next sequence)."""
        BT: gl.constexpr = q_b.shape[0]
        c = item // H
        hh = item % H
        bos, eos = _chunk_bounds(chunks_ptr, c)
        # [64, K] tiles: 8 contiguous channels (32 B of fp32 G) per thread, a row in 16 threads
        ROWS_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
        r = gl.arange(0, BT, layout=gl.SliceLayout(1, ROWS_L))
        kc = gl.arange(0, K, layout=gl.SliceLayout(0, ROWS_L))
        valid = (bos + r < eos)[:, None]
        # the middle row as `_chunk_gate_offsets` takes it (eos is the sequence's end, not the chunk's)
        m = bos + (gl.minimum(eos - bos, BT) - 1) // 2
        Gm = gl.load(G_ptr + (m.to(gl.int64) * H + hh) * K + kc)
        # lint: allow TP001 -- G's rows, masked past the sequence, meet Q and K in registers (fp32 or fp64 G: no TMA tile is used as loaded)
        Gt = gl.load(G_ptr + ((bos + r).to(gl.int64) * H + hh)[:, None] * K + kc[None, :], mask=valid, other=0.0)
        d = gl.where(valid, (Gt - Gm[None, :]).to(gl.float32), 0.0)

        kd_b.store((k_b.load(ROWS_L).to(gl.float32) * gl.exp(-d)).to(kd_b.dtype))
        fence_async_shared()  # generic-proxy writes, then the async proxy (WGMMA) reads
        gl.thread_barrier()
        q = q_b.load(ROWS_L).to(gl.float32)
        qd = gl.convert_layout((q * gl.exp(d)).to(q_b.dtype), gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2))
        s = warpgroup_mma(qd, kd_b.permute((1, 0)), gl.zeros([BT, BT], gl.float32, S_L))
        qg = gl.convert_layout((q * gl.exp(d + Gm.to(gl.float32)[None, :])).to(q_b.dtype),
                               gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
        o = warpgroup_mma(qg, h_b, gl.zeros([BT, V], gl.float32, O_L))

        rs = gl.arange(0, BT, layout=gl.SliceLayout(1, S_L))
        cs = gl.arange(0, BT, layout=gl.SliceLayout(0, S_L))
        keep = (rs[:, None] >= cs[None, :]) & (bos + rs < eos)[:, None] & (bos + cs < eos)[None, :]
        P = gl.convert_layout(gl.where(keep, s, 0.0).to(vn_b.dtype),
                              gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
        o = warpgroup_mma(P, vn_b, o)

        ro = gl.arange(0, BT, layout=gl.SliceLayout(1, O_L))
        co = gl.arange(0, V, layout=gl.SliceLayout(0, O_L))
        offs = ((bos + ro).to(gl.int64) * H + hh)[:, None] * V + co[None, :]
        # lint: allow TP001 -- a varlen chunk's tail rows belong to the next sequence: a 64-row TMA store would overwrite them; the masked store writes only this chunk's rows
        gl.store(o_ptr + offs, (o * scale).to(o_ptr.dtype.element_ty), mask=(bos + ro < eos)[:, None])

    @gluon.jit
    def _kda_output_wgmma_kernel(q_desc, k_desc, vn_desc, h_desc, G_ptr, o_ptr, chunks_ptr, flags_ptr, H, scale,
                                 K: gl.constexpr, V: gl.constexpr):
        """Stage 6 for one chunk and head whose flag (stage 3's, int8 [NC, H]) is clear, in o's dtype;
        grid (NC, H), 4 warps; a flagged chunk's program returns (Triton's block kernel takes it).
        q, k [Ntok, H*K], Vn [Ntok, H*V] and h [NC*H*K, V] (bf16) come in through TMA on one
        mbarrier, G [Ntok, H, K] (fp32 or fp64) by loads into registers.
        Explicit here (Triton would choose): the descriptors and the barrier, the shared buffer of
        the scaled keys and its fence, the accumulator layouts of the three WGMMAs (S [64, 64],
        O [64, V]), which operands come from registers (both scaled Q and P) and which from
        shared memory (h, Vn, and the scaled K^T as a transposed view)."""
        BT: gl.constexpr = q_desc.block_type.shape[0]
        c = gl.program_id(0)
        hh = gl.program_id(1)
        q_s = gl.allocate_shared_memory(q_desc.dtype, [BT, K], q_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
        kd_s = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
        vn_s = gl.allocate_shared_memory(vn_desc.dtype, [BT, V], vn_desc.layout)
        h_s = gl.allocate_shared_memory(h_desc.dtype, [K, V], h_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if gl.load(flags_ptr + c * H + hh) == 0:
            mbarrier.init(bar, count=1)
            fence_async_shared()
            item = c * H + hh
            _issue_chunk_tiles(q_desc, k_desc, vn_desc, h_desc, chunks_ptr, item, H, q_s, k_s, vn_s, h_s, bar, K, V)
            mbarrier.wait(bar, 0)
            _kda_chunk_output(q_s, k_s, vn_s, h_s, kd_s, G_ptr, o_ptr, chunks_ptr, item, H, scale, K, V)
            mbarrier.invalidate(bar)


def chunk_output_kda_gluon(q, k, G, h, vn, scale: float, plan, out_dtype: torch.dtype, span_flags=None):
    """Stage 6 (`triton_kernels.chunk_output_kda`'s contract): the unflagged chunks on the Gluon kernel,
    the flagged ones on Triton's block kernel; Triton's stage 6 whole where stage 3 made no flags
    (DIAGONAL_FORM other than "chunk") or the tiles are not all bf16."""
    if span_flags is None or any(x.dtype != torch.bfloat16 for x in (q, k, h, vn)):
        return kk.chunk_output_kda(q, k, G, h, vn, scale, plan, out_dtype, span_flags)
    Ntok, H, K = q.shape
    V = vn.shape[-1]
    o = new_empty((Ntok, H, V), out_dtype, q.device)
    if plan.NC:
        _kda_output_wgmma_kernel[(plan.NC, H)](*chunk_tile_descriptors(q, k, vn, h, plan), G, o, plan.chunks,
                                               span_flags, H, float(scale), K, V, num_warps=4)
        kk.output_flagged_chunks(q, k, G, h, vn, o, scale, plan, span_flags)
    return o


def kda_forward_gluon(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                      keep_for_backward: bool = False):
    """Triton's forward with stage 6 on `chunk_output_kda_gluon` (keep_for_backward as there)."""
    return kk.kda_forward_triton(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                 cu_seqlens, output=chunk_output_kda_gluon, keep_for_backward=keep_for_backward)


def kda_backward_gluon(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                       kept=None):
    """Triton's backward with its two state recurrences (the recompute's stage 5 and stage 8) on
    GDN's Gluon tf32 recurrence kernel in its PER_CHANNEL form, where that kernel takes them
    (`gdn.gluon_kernels.recurrence_kernel_for`: tf32 products on fp32 operands; Triton's otherwise);
    kept: what the forward kept (`triton_kernels.KeptTiles`), as there."""
    return kk.kda_backward_triton(do, dht, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                  cu_seqlens, states=chunk_states_recompute_gluon, dstates=chunk_dstates_gluon,
                                  kept=kept)


# --------------------------------------------------------------------------------------------
# CPU compile checks (tileport.compile_check)
# --------------------------------------------------------------------------------------------
def compile_cases():
    """The output kernel at K = V = 128 and 64, with G in fp32 (16-bit inputs' GATE_SUMS_16BIT
    default) and, at 128, fp64."""
    if _GLUON_ERROR is not None:
        return []
    from tileport.compile_check import CompileCase, TensorStandIn, descriptor_stand_in

    cases = []
    Ntok, H, NC = 32768, 16, 512
    bf = torch.bfloat16
    expect = ["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait"]
    for K, g_dtype in ((128, torch.float32), (128, torch.float64), (64, torch.float32)):
        V = K

        def desc(rows, cols, block):
            return descriptor_stand_in([rows, cols], bf, block, _smem_layout(block, bf))

        args = dict(q_desc=desc(Ntok, H * K, [BT, K]), k_desc=desc(Ntok, H * K, [BT, K]),
                    vn_desc=desc(Ntok, H * V, [BT, V]), h_desc=desc(NC * H * K, V, [K, V]),
                    G_ptr=TensorStandIn([Ntok, H, K], g_dtype), o_ptr=TensorStandIn([Ntok, H, V], bf),
                    chunks_ptr=TensorStandIn([2 * NC], torch.int64),  # int64: keeps the int32 cast of TMA coordinates tested
                    flags_ptr=TensorStandIn([NC, H], torch.int8), H=H, scale=0.1, K=K, V=V)
        tag = f"K{K}_V{V}_G{'fp32' if g_dtype == torch.float32 else 'fp64'}"
        cases.append(CompileCase(name=f"kda_output_{tag}", kernel=_kda_output_wgmma_kernel, args=args, num_warps=4,
                                 expect_ptx=expect, expect_max_spills=0, expect_max_shared=SMEM_PER_SM // 2))
    return cases
