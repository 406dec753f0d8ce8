"""Kimi Delta Attention benchmark suite: GDN's shapes and cost model with a per-channel gate.

The matmul flops are GDN's (the chunked form is the same; the per-channel gate only scales q, k
and the state element-wise). The bytes differ by the gate: g is [B, T, H, K] instead of
[B, T, H], read once forward, and dg is written once backward (fp32 here, as FLA's callers pass it).
"""

from __future__ import annotations

from tileport.ops.gdn import perf as gdn_perf

STANDARD = gdn_perf.STANDARD
SMALL = gdn_perf.SMALL
LEAF_KINDS = gdn_perf.LEAF_KINDS
# (until the fifth session tileport's KDA gradients came from the float64 reverse sweep and the
# bench timed the forward only; the Triton backward now runs, so bwd and fwdbwd are timed too)


def minimal_cost(shape: dict, elem_bytes: int, mode: str) -> tuple[int, int]:
    nbytes, flops = gdn_perf.minimal_cost(shape, elem_bytes, mode)
    tok = shape["B"] * shape["T"] * shape["H"]
    gate_extra = tok * (shape["K"] - 1) * 4  # g (and dg) per key channel instead of one per head
    per_mode = {"fwd": 1, "bwd": 2, "fwdbwd": 3}[mode]  # fwd reads g; bwd reads g, writes dg
    return nbytes + per_mode * gate_extra, flops


def make_inputs(shape: dict, dtype, device, torch):
    inputs = gdn_perf.make_inputs(shape, dtype, device, torch)
    B, T, H, K = (shape[x] for x in "BTHK")
    inputs["g"] = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=device, dtype=torch.float32))
    return inputs


differentiable = gdn_perf.differentiable


def reference(inputs: dict):
    from tileport.ops.kda.reference import chunked_reference

    o, _ = chunked_reference(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                             use_qk_l2norm_in_kernel=True)
    return o


def systems(torch):
    import tileport
    from tileport.dispatch import use_backend

    def ours(backend):
        def run(inp):
            with use_backend(backend, op="kda"):
                o, _ = tileport.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                          use_qk_l2norm_in_kernel=True)
            return o

        return run

    def fla(inp):
        from fla.ops.kda import chunk_kda as fla_kda

        o, _ = fla_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], use_qk_l2norm_in_kernel=True)
        return o

    baselines = gdn_perf.systems(torch)
    return {"gluon": ours("gluon"), "triton": ours("triton"), "fla": fla, "torch": baselines["torch"]}
