"""Grouped GEMM benchmark suite: shapes, the systems compared, the minimal bytes and flops.

A shape is G groups of mean M rows (the row counts are ragged: M * (0.25 ... 1.75), summing to
G * M), one K and N. With S = sum M_i and e bytes an element:
    forward           bytes (S*K + G*K*N + S*N) e              flops 2 S K N
    backward          bytes (2 S*K + 2 G*K*N + S*N) e          flops 4 S K N   (d a and d b)
    forward+backward  the sums
The floor is the flops term at these shapes (matmul bound).
"""

from __future__ import annotations

from tileport.ops.grouped_gemm.reference import grouped_gemm_reference

STANDARD = [dict(G=8, M=2048, K=4096, N=4096), dict(G=64, M=256, K=2048, N=1408), dict(G=4, M=4096, K=4096, N=14336)]
SMALL = [dict(G=3, M=40, K=64, N=48), dict(G=2, M=33, K=96, N=40)]


def row_counts(shape: dict) -> list[int]:
    G, M = shape["G"], shape["M"]
    if G == 1:
        return [M]
    ms = [int(M * (0.25 + 1.5 * i / (G - 1))) for i in range(G)]
    ms[-1] += G * M - sum(ms)
    return ms


def minimal_cost(shape: dict, elem_bytes: int, mode: str) -> tuple[int, int]:
    G, K, N = shape["G"], shape["K"], shape["N"]
    S = G * shape["M"]
    fwd = ((S * K + G * K * N + S * N) * elem_bytes, 2 * S * K * N)
    bwd = ((2 * S * K + 2 * G * K * N + S * N) * elem_bytes, 4 * S * K * N)
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return bwd
    return fwd[0] + bwd[0], fwd[1] + bwd[1]


def make_inputs(shape: dict, dtype, device, torch):
    K, N = shape["K"], shape["N"]
    a = [torch.randn(m, K, device=device, dtype=dtype) for m in row_counts(shape)]
    b = [(torch.randn(K, N, device=device) / K**0.5).to(dtype) for _ in range(shape["G"])]
    return dict(a=a, b=b)


def differentiable(inputs: dict) -> list:
    return [*inputs["a"], *inputs["b"]]


def reference(inputs: dict):
    import torch

    return torch.cat(grouped_gemm_reference(inputs["a"], inputs["b"]))


# timed by default beside DEFAULT_SYSTEMS: issue 8's bar is the faster of torch's grouped GEMM
# and a loop of torch.matmul ("torch")
EXTRA_BASELINES = ("torch_grouped_mm",)


def systems(torch):
    import tileport.ops.grouped_gemm as gg
    from tileport.dispatch import use_backend
    from tileport.bench import compiled_system

    def ours(backend):
        def run(inp):
            with use_backend(backend, op="grouped_gemm"):
                return gg.grouped_gemm_stacked(inp["a"], inp["b"])

        return run

    def loop(a, b):
        # forward only (the bench's "fwd" runs under no_grad): each product into its rows of one
        # stacked buffer (what the op returns), not a cat of G results, which copied the whole
        # output again (H200: 0.87 ms with it, 0.72 without; docs/perf/llm_ops.md row 6). out=
        # does not differentiate, so with gradients the cat stays
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*a, *b)):
            return torch.cat([x @ w for x, w in zip(a, b)])
        c = torch.empty(sum(x.shape[0] for x in a), b[0].shape[1], dtype=a[0].dtype, device=a[0].device)
        start = 0
        for x, w in zip(a, b):
            torch.matmul(x, w, out=c[start:start + x.shape[0]])
            start += x.shape[0]
        return c

    def grouped_mm(inp):
        # torch's own grouped GEMM (CUTLASS on sm_90, bf16): A stacked [sum M_i, K], B [G, K, N],
        # offs = the groups' row ends; the stacking copies are part of its time, as for a caller
        # holding separate a_i and b_i (tileport's backends take the lists as they are)
        a, b = inp["a"], inp["b"]
        ends = torch.tensor([x.shape[0] for x in a], device=a[0].device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(torch.cat(a), torch.stack(b), offs=ends)

    torch_compiled = compiled_system(torch, loop, lambda inp: (inp["a"], inp["b"]))
    return {"gluon": ours("gluon"), "triton": ours("triton"), "cutile": ours("cutile"), "reference": ours("reference"),
            "torch": lambda inp: loop(inp["a"], inp["b"]), "torch_grouped_mm": grouped_mm,
            "torch_compile": torch_compiled}
