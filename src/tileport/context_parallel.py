"""Context parallelism for the delta-rule ops: one sequence axis split over a process group.

Each rank holds a contiguous slice of the tokens (rank order = token order; slices may have any
length >= 1, a chunk of 64 may straddle two ranks). The state recurrence is affine in the state
that enters a slice: for one sequence piece on one rank,

    S_out = M S_in + C,    M = the product of the piece's per-token transitions  [K, K],
                           C = the piece's final state when S_in = 0           [K, V],

so a rank needs only (M, C) from the ranks before it, not their tokens. Per call:

    1. C: the op on the local slice with zero state entering a piece continued from the
       previous rank (the local first piece; every batch row when dense), and each piece that
       starts here from its own initial state;
    2. M: the op on that continued piece with v = 0 and the identity as initial state (the final
       state is then M itself: the recurrence maps S_in = I to M I);
    3. all ranks gather (M, C) and scan them in rank order to the state entering their slice;
    4. the op again on the local slice from the true entering state: outputs and final states.

A rank whose first piece continues nothing skips 2 and 4 (1 already is the answer). Every step
is made of the op itself (any backend: Gluon, Triton, the reference) and of torch ops, and the
gather is differentiable (its backward sums the gradients of all ranks, then each keeps its own),
so autograd gives the gradients; backward is collective too (one all_reduce), and every rank must
backpropagate through its o (a rank that does not leaves the others waiting). The cost is
about three local forwards per rank plus two [H, K, K] + [H, K, V] gathers: correct first, the
communication/compute overlap is not done yet.

Works with any torch.distributed backend (gloo on CPU tensors, NCCL on CUDA ones).

Final states: the state at the end of each local piece (dense: [B, H, K, V]; varlen: one per
local piece, in order). A sequence's final state is the one on the rank that holds its end (the
last rank, dense).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherFromRanks(torch.autograd.Function):
    """[W, *x.shape]: x from every rank of the group. Backward: the gradients of all ranks are
    summed (all_reduce), and each rank keeps the slice of its own x."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather_from_ranks(x: torch.Tensor, group=None) -> torch.Tensor:
    return _GatherFromRanks.apply(x, group)


class _TiedToGather(torch.autograd.Function):
    """(o, ht) unchanged, made to depend on the gathered summaries: the gather's backward is a
    collective, so every rank must run it, also a rank that uses none of the summaries (rank 0,
    or every rank whose first piece starts a sequence). Zero gradient to the summaries."""

    @staticmethod
    def forward(ctx, o, ht, gathered):
        ctx.shape, ctx.dtype = gathered.shape, gathered.dtype
        return o.view_as(o), ht.view_as(ht)

    @staticmethod
    def backward(ctx, do, dht):
        return do, dht, torch.zeros(ctx.shape, dtype=ctx.dtype, device=do.device)


def _exchange(C, M, group):
    """[W, ..., K, V] and [W, ..., K, K]: (C, M) of every rank, in ONE differentiable gather, so
    that every rank's backward runs the same single collective (two gathers could run their
    backward all_reduces in different orders on different ranks)."""
    V = C.shape[-1]
    both = gather_from_ranks(torch.cat([C, M], dim=-1), group)
    return both, both[..., :V], both[..., V:]


def _slice_lengths(T_local: int, device, group) -> list[int]:
    """Every rank's slice length (a non-differentiable all_gather of one integer)."""
    mine = torch.tensor([T_local], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [int(p.item()) for p in parts]


def _scan_entering_state(Ms, Cs, continues, single, rank):
    """The state entering this rank's first piece, from the ranks before it: rank j hands on
    M_j S_j + C_j when its first piece continues and is also its last (S_j = what entered j),
    else C_j (its last piece started on j, so C_j is exact)."""
    carry = None
    for j in range(rank):
        if continues[j] and single[j] and carry is not None:
            carry = torch.matmul(Ms[j], carry) + Cs[j]
        else:
            carry = Cs[j]
    return carry


def context_parallel(op, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, group=None):
    """The delta-rule op `op` (tileport.chunk_gated_delta_rule or tileport.chunk_kda) over the
    sequence axis split across `group` (default: the world). Arguments as the op's, local slices
    [B, T_local, H, ...]; cu_seqlens and initial_state are the GLOBAL ones, the same on every rank.
    Returns (o of the local slice, final states of the local pieces or None)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel: torch.distributed is not initialised (init_process_group first)")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("context_parallel: q must be a [B, T_local, H, K] tensor")
    W, r = dist.get_world_size(group), dist.get_rank(group)
    B, T_local, H, K = q.shape
    if T_local < 1:
        raise ValueError(f"context_parallel: every rank must hold at least one token (rank {r} has T_local=0)")
    lengths = _slice_lengths(T_local, q.device, group)
    start = sum(lengths[:r])
    end = start + T_local
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    if cu_seqlens is None:
        # B sequences, each split at the same rank borders: every rank's pieces continue the previous
        # rank's (but rank 0's), and each piece is also the rank's last.
        continues_here = r > 0
        C = M = None
        if not continues_here:
            o, ht = op(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, **kw)
            C = ht
        elif r < W - 1:
            _, C = op(q, k, v, g, beta, initial_state=None, output_final_state=True, **kw)
        if continues_here:
            eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(B, H, K, K).contiguous()
            _, M = op(q, k, torch.zeros_like(k).to(v.dtype), g, beta, initial_state=eye, output_final_state=True, **kw)
        V = v.shape[-1]
        C = C if C is not None else q.new_zeros((B, H, K, V), dtype=torch.float32)
        M = M if M is not None else q.new_zeros((B, H, K, K), dtype=torch.float32)
        both, Cs, Ms = _exchange(C, M, group)
        if continues_here:
            entering = _scan_entering_state(Ms, Cs, [j > 0 for j in range(W)], [True] * W, r)
            o, ht = op(q, k, v, g, beta, initial_state=entering, output_final_state=True, **kw)
        o, ht = _TiedToGather.apply(o, ht, both)
        return o, (ht if output_final_state else None)

    # varlen: B = 1, the global cu_seqlens cut into this rank's pieces
    if B != 1:
        raise ValueError(f"context_parallel: with cu_seqlens, q must have batch size 1 (got {B})")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[-1] != sum(lengths):
        raise ValueError(f"context_parallel: cu_seqlens ends at {cu[-1]} but the ranks hold {sum(lengths)} tokens")
    cuts = sorted({start, end, *[c for c in cu if start < c < end]})
    local_cu = torch.tensor([c - start for c in cuts], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    # the global sequence of each local piece: the last boundary at or before its first token
    seq_of = [max(i for i in range(len(cu) - 1) if cu[i] <= a and (cu[i + 1] > a)) for a in cuts[:-1]]
    continues_here = start not in cu
    n_pieces = len(cuts) - 1
    V = v.shape[-1]

    def inits(first_state):
        if initial_state is None and first_state is None:
            return None
        rows = []
        for p, s in enumerate(seq_of):
            if p == 0 and continues_here:
                rows.append(first_state if first_state is not None else q.new_zeros((H, K, V), dtype=torch.float32))
            elif initial_state is not None:
                rows.append(initial_state[s])
            else:
                rows.append(q.new_zeros((H, K, V), dtype=torch.float32))
        return torch.stack(rows)

    o, ht = op(q, k, v, g, beta, initial_state=inits(None), output_final_state=True, cu_seqlens=local_cu, **kw)
    C = ht[-1] if end not in cu else q.new_zeros((H, K, V), dtype=torch.float32)
    if continues_here:
        n0 = cuts[1] - cuts[0]
        eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(1, H, K, K).contiguous()
        _, M = op(q[:, :n0], k[:, :n0], torch.zeros_like(k[:, :n0]).to(v.dtype), g[:, :n0], beta[:, :n0],
                  initial_state=eye, output_final_state=True, **kw)
        M = M[0]
    else:
        M = q.new_zeros((H, K, K), dtype=torch.float32)
    flags = torch.tensor([int(continues_here), int(n_pieces == 1)], device=q.device)
    flag_parts = [torch.empty_like(flags) for _ in range(W)]
    dist.all_gather(flag_parts, flags, group=group)
    both, Cs, Ms = _exchange(C, M, group)
    if continues_here:
        entering = _scan_entering_state(Ms, Cs, [bool(f[0]) for f in flag_parts], [bool(f[1]) for f in flag_parts], r)
        o, ht = op(q, k, v, g, beta, initial_state=inits(entering), output_final_state=True, cu_seqlens=local_cu, **kw)
    o, ht = _TiedToGather.apply(o, ht, both)
    return o, (ht if output_final_state else None)
