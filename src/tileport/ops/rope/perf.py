"""RoPE (rotate-half) benchmark suite: shapes, the systems compared, minimal bytes and flops.

Minimal traffic, n = B * T * H * D elements of x (e bytes), cos and sin [T, D] in fp32:
    forward           2 * n * e + 2 * T * D * 4     read x, cos, sin; write y
    backward          same                          read dy, cos, sin; write dx
    forward+backward  twice that
Flops ~3 per element: the floor is bytes.
"""

from __future__ import annotations

from tileport.ops.rope.reference import rope_reference

STANDARD = [dict(B=8, T=4096, H=32, D=128), dict(B=1, T=32768, H=16, D=128), dict(B=4, T=4096, H=40, D=64)]
SMALL = [dict(B=2, T=37, H=3, D=64), dict(B=1, T=16, H=5, D=96)]


def minimal_cost(shape: dict, elem_bytes: int, mode: str) -> tuple[int, int]:
    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    one = 2 * B * T * H * D * elem_bytes + 2 * T * D * 4
    k = 2 if mode == "fwdbwd" else 1
    return k * one, k * 3 * B * T * H * D


def make_inputs(shape: dict, dtype, device, torch):
    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    ang = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return dict(x=torch.randn(B, T, H, D, device=device, dtype=dtype), cos=ang.cos(), sin=ang.sin())


def differentiable(inputs: dict) -> list:
    return [inputs["x"]]


def reference(inputs: dict):
    return rope_reference(inputs["x"], inputs["cos"], inputs["sin"])


def _torch_rope(torch, x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return (x * c + rot * s).to(x.dtype)


def systems(torch):
    import tileport
    from tileport.dispatch import use_backend
    from tileport.bench import compiled_system

    def ours(backend):
        def run(inp):
            with use_backend(backend, op="rope"):
                return tileport.rope(inp["x"], inp["cos"], inp["sin"])

        return run

    torch_compiled = compiled_system(torch, lambda x, c, s: _torch_rope(torch, x, c, s),
                                     lambda inp: (inp["x"], inp["cos"], inp["sin"]))
    return {"triton": ours("triton"), "cutile": ours("cutile"), "reference": ours("reference"),
            "torch": lambda inp: _torch_rope(torch, inp["x"], inp["cos"], inp["sin"]), "torch_compile": torch_compiled}
