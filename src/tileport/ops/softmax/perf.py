"""Softmax (last dim) benchmark suite: shapes, the systems compared, and the minimal bytes and flops.

Minimal traffic, M rows of D, e bytes:
    forward           2 * M * D * e      read x, write y
    backward          3 * M * D * e      read y and dy, write dx
    forward+backward  5 * M * D * e
Flops ~5 per element forward (max, sub, exp, sum, scale), ~4 backward: the floor is bytes.
The last shape (D = 131072, a vocabulary) takes the chunked two-pass path.
"""

from __future__ import annotations

from tileport.ops.softmax.reference import softmax_reference

STANDARD = [dict(M=8192, D=4096), dict(M=32768, D=1024), dict(M=1024, D=131072)]
SMALL = [dict(M=64, D=128), dict(M=37, D=96)]


def minimal_cost(shape: dict, elem_bytes: int, mode: str) -> tuple[int, int]:
    M, D = shape["M"], shape["D"]
    per, fl = {"fwd": (2, 5), "bwd": (3, 4), "fwdbwd": (5, 9)}[mode]
    return per * M * D * elem_bytes, fl * M * D


def make_inputs(shape: dict, dtype, device, torch):
    return dict(x=(3.0 * torch.randn(shape["M"], shape["D"], device=device)).to(dtype))


def differentiable(inputs: dict) -> list:
    return [inputs["x"]]


def reference(inputs: dict):
    return softmax_reference(inputs["x"])


def systems(torch):
    import tileport
    from tileport.dispatch import use_backend
    from tileport.bench import compiled_system

    def ours(backend):
        def run(inp):
            with use_backend(backend, op="softmax"):
                return tileport.softmax(inp["x"])

        return run

    torch_compiled = compiled_system(torch, lambda x: torch.softmax(x, dim=-1), lambda inp: (inp["x"],))
    return {"gluon": ours("gluon"), "triton": ours("triton"), "cutile": ours("cutile"), "reference": ours("reference"),
            "torch": lambda inp: torch.softmax(inp["x"], dim=-1), "torch_compile": torch_compiled}
