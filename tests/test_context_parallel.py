"""Context parallelism (tileport.context_parallel) over 2 and 4 gloo processes on the CPU.

Each process holds a contiguous slice of the same global inputs (slices of uneven length, chunks
of 64 split between ranks, a rank of one token, varlen sequences crossing one and two rank
borders); outputs, final states and the gradients of q, k, v, g, beta and the initial state must
equal the single-process op on the whole sequence (same backend) within the parity-gate bounds.
"""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import tileport
from tileport.context_parallel import context_parallel
from tileport.testing import GATE, OUTPUT, backend_skip_reason, check, use_backend

OPS = {"gdn": tileport.chunk_gated_delta_rule, "kda": tileport.chunk_kda}

# id: (op, backend, B, splits (tokens per rank), H, K, V, cu_seqlens or None)
CASES = {
    "gdn-dense-2ranks-midchunk": ("gdn", "reference", 2, [70, 60], 2, 32, 16, None),
    "gdn-dense-2ranks-triton": ("gdn", "triton", 2, [70, 60], 2, 32, 16, None),
    "gdn-dense-4ranks-one-token-rank": ("gdn", "reference", 1, [33, 64, 1, 102], 2, 32, 16, None),
    "gdn-varlen-2ranks": ("gdn", "reference", 1, [100, 80], 2, 32, 16, [0, 50, 51, 180]),
    "gdn-varlen-4ranks-spanning-three": ("gdn", "reference", 1, [30, 40, 60, 70], 1, 32, 16, [0, 20, 170, 200]),
    "kda-dense-2ranks": ("kda", "reference", 1, [65, 40], 2, 32, 16, None),
}


def _inputs(op, B, T, H, K, V, N, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    gshape = (B, T, H, K) if op == "kda" else (B, T, H)
    g = F.logsigmoid(torch.randn(*gshape, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    h0 = 0.5 * torch.randn(N, H, K, V, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    dht = torch.randn(N, H, K, V, generator=gen)
    return q, k, v, g, beta, h0, do, dht


def _worker(rank, world, port, case_id, seed, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        op, backend, B, splits, H, K, V, cu = CASES[case_id]
        T, N = sum(splits), (B if cu is None else len(cu) - 1)
        q, k, v, g, beta, h0, do, dht = _inputs(op, B, T, H, K, V, N, seed)
        a, b = sum(splits[:rank]), sum(splits[: rank + 1])
        local = [x[:, a:b].clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        h0.requires_grad_(True)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        with use_backend(backend, op=op):
            o, ht = context_parallel(OPS[op], *local, scale=0.3, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t)
            loss = (o * do[:, a:b]).sum()
            if cu is None:
                if rank == world - 1:  # the global final states are the last rank's
                    loss = loss + (ht * dht).sum()
            else:  # a local piece that ends its sequence holds that sequence's final state
                cuts = sorted({a, b, *[c for c in cu if a < c < b]})
                for p in range(len(cuts) - 1):
                    if cuts[p + 1] in cu:
                        s = max(i for i in range(N) if cu[i] <= cuts[p] < cu[i + 1])
                        loss = loss + (ht[p] * dht[s]).sum()
            loss.backward()
        dh0 = h0.grad.clone() if h0.grad is not None else torch.zeros_like(h0)
        dist.all_reduce(dh0)  # each rank holds the part of d initial_state that flowed through it
        torch.save(dict(o=o.detach(), grads=[x.grad for x in local], dh0=dh0,
                        ht=ht.detach() if (cu is None and rank == world - 1) else None),
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case_id", list(CASES))
def test_context_parallel_matches_one_process(case_id, seed):
    op, backend, B, splits, H, K, V, cu = CASES[case_id]
    reason = backend_skip_reason(op, backend, "cpu")
    if reason:
        pytest.skip(f"{backend}: {reason}")
    world = len(splits)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, _free_port(), case_id, seed, out_dir), nprocs=world, join=True)
        parts = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]

    T, N = sum(splits), (B if cu is None else len(cu) - 1)
    q, k, v, g, beta, h0, do, dht = _inputs(op, B, T, H, K, V, N, seed)
    leaves = [q, k, v, g, beta, h0]
    for t in leaves:
        t.requires_grad_(True)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    with use_backend(backend, op=op):
        o, ht = OPS[op](q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t)
        grads = torch.autograd.grad([o, ht], leaves, [do, dht])

    where = f"[{case_id} seed={seed}]"
    check(f"o {where}", torch.cat([p["o"] for p in parts], 1), o, torch.float32)
    if cu is None:
        check(f"final_state {where}", parts[-1]["ht"], ht, torch.float32)
    for i, (name, kind) in enumerate(zip(["dq", "dk", "dv", "dg", "dbeta"], [OUTPUT, OUTPUT, OUTPUT, GATE, GATE])):
        check(f"{name} {where}", torch.cat([p["grads"][i] for p in parts], 1), grads[i], torch.float32, kind)
    check(f"d initial_state {where}", parts[0]["dh0"], grads[5], torch.float32)


def test_needs_an_initialised_process_group():
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel(tileport.chunk_gated_delta_rule, q, q, q, torch.zeros(1, 4, 1), torch.ones(1, 4, 1))
