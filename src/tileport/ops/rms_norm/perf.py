"""RMSNorm benchmark suite: shapes, the systems compared, and the minimal bytes and flops.

Minimal traffic (each input read once, each output written once), M rows of D, e bytes:
    forward           2 * M * D * e  (+ D * e for the weight)       read x, write y
    backward          3 * M * D * e  (+ 2 * D * e)                  read x and dy, write dx (and dw)
    forward+backward  5 * M * D * e  (+ 3 * D * e)
Flops: ~4 per element forward, ~10 backward: far under the matmul rate, so the floor is bytes.
"""

from __future__ import annotations

from tileport.ops.rms_norm.reference import rms_norm_reference

STANDARD = [dict(M=8192, D=4096), dict(M=16384, D=8192), dict(M=65536, D=1024)]
SMALL = [dict(M=64, D=128), dict(M=37, D=96)]
EPS = 1e-6


def minimal_cost(shape: dict, elem_bytes: int, mode: str) -> tuple[int, int]:
    M, D = shape["M"], shape["D"]
    per, w, fl = {"fwd": (2, 1, 4), "bwd": (3, 2, 10), "fwdbwd": (5, 3, 14)}[mode]
    return (per * M * D + w * D) * elem_bytes, fl * M * D


def make_inputs(shape: dict, dtype, device, torch):
    M, D = shape["M"], shape["D"]
    return dict(x=torch.randn(M, D, device=device, dtype=dtype),
                weight=(0.5 + torch.rand(D, device=device)).to(dtype))


def differentiable(inputs: dict) -> list:
    return [inputs["x"], inputs["weight"]]


def reference(inputs: dict):
    return rms_norm_reference(inputs["x"], inputs["weight"], EPS)


def systems(torch):
    from tileport.bench import compiled_system

    """name -> callable(inputs) -> y; raising marks a refusal."""
    import tileport
    from tileport.dispatch import use_backend

    def ours(backend):
        def run(inp):
            with use_backend(backend, op="rms_norm"):
                return tileport.rms_norm(inp["x"], inp["weight"], EPS)

        return run

    def torch_eager(inp):
        x = inp["x"]
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), inp["weight"], EPS)

    torch_compiled = compiled_system(
        torch, lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS), lambda inp: (inp["x"], inp["weight"]))
    return {"gluon": ours("gluon"), "triton": ours("triton"), "cutile": ours("cutile"), "reference": ours("reference"),
            "torch": torch_eager, "torch_compile": torch_compiled}
