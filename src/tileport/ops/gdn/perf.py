"""Gated DeltaNet benchmark suite: shapes, systems compared, minimal bytes and flops.

Minimal traffic, forward (e bytes per element of q, k, v, o; gates and beta in fp32):
    read q, k [B,T,H,K], v [B,T,H,V], g, beta [B,T,H]; write o [B,T,H,V]
Backward adds reading do and writing dq, dk, dv, dg, dbeta. Flops (matmuls of the chunked form,
chunk C = 64, per chunk and head): forward 2C^2K (k k^T) + 2C^2K + 2C^2V (W, U) + 2CKV (U - W h)
+ 2KCV (h update) + 2CKV (q h) + 2C^2K + 2C^2V (intra-chunk attention), plus ~C^3/3 (solve);
the backward is taken as 2.5x the forward's flops.
"""

from __future__ import annotations

CHUNK = 64
STANDARD = [dict(B=8, T=4096, H=16, K=128, V=128), dict(B=1, T=32768, H=16, K=128, V=128)]
SMALL = [dict(B=1, T=65, H=2, K=64, V=64)]


def _fwd_flops(s: dict) -> int:
    C, K, V = CHUNK, s["K"], s["V"]
    per_chunk_head = 2 * C * C * K * 3 + 2 * C * C * V * 2 + 2 * C * K * V * 3 + C**3 // 3
    chunks = s["B"] * s["H"] * -(-s["T"] // C)
    return per_chunk_head * chunks


def minimal_cost(shape: dict, elem_bytes: int, mode: str) -> tuple[int, int]:
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    tok = B * T * H
    fwd_bytes = tok * (2 * K + 2 * V) * elem_bytes + tok * 2 * 4
    bwd_bytes = tok * (2 * K + V) * elem_bytes + tok * V * elem_bytes + tok * (2 * K + V) * elem_bytes + tok * 2 * 4 * 2
    f = _fwd_flops(shape)
    return {"fwd": (fwd_bytes, f), "bwd": (bwd_bytes, int(2.5 * f)), "fwdbwd": (fwd_bytes + bwd_bytes, int(3.5 * f))}[mode]


def make_inputs(shape: dict, dtype, device, torch):
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    q = torch.randn(B, T, H, K, device=device, dtype=dtype)
    k = torch.randn(B, T, H, K, device=device, dtype=dtype)
    v = torch.randn(B, T, H, V, device=device, dtype=dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device, dtype=torch.float32))
    beta = torch.sigmoid(torch.randn(B, T, H, device=device, dtype=torch.float32)).to(dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def differentiable(inputs: dict) -> list:
    return [inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"]]


LEAF_KINDS = ["output", "output", "output", "gate", "gate"]


def reference(inputs: dict):
    from tileport.ops.gdn.reference import chunked_reference

    o, _ = chunked_reference(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                             use_qk_l2norm_in_kernel=True)
    return o


def systems(torch):
    import tileport
    from tileport.dispatch import use_backend

    def ours(backend):
        def run(inp):
            with use_backend(backend, op="gdn"):
                o, _ = tileport.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                                       use_qk_l2norm_in_kernel=True)
            return o

        return run

    def fla(inp):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

        o, _ = fla_gdn(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], use_qk_l2norm_in_kernel=True)
        return o

    def sdpa(inp):
        # A different op (softmax attention), timed on the same q, k, v for scale: what a user
        # would otherwise run for this layer. Not checked against the GDN reference.
        q, k, v = (inp[x].transpose(1, 2) for x in "qkv")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    sdpa.different_op = "softmax attention (SDPA causal), same q/k/v, for scale"
    return {"gluon": ours("gluon"), "triton": ours("triton"), "fla": fla, "torch": sdpa}
