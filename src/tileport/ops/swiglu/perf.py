"""SwiGLU (silu-and-mul) benchmark suite: shapes, the systems compared, minimal bytes and flops.

Minimal traffic, n = M * D elements, e bytes:
    forward           3 * n * e      read x and y, write out
    backward          5 * n * e      read x, y and dout, write dx and dy
    forward+backward  8 * n * e
Flops ~5 per element forward, ~10 backward: the floor is bytes.
"""

from __future__ import annotations

from tileport.ops.swiglu.reference import swiglu_reference

STANDARD = [dict(M=8192, D=4096), dict(M=8192, D=14336), dict(M=16384, D=11008)]
SMALL = [dict(M=64, D=128), dict(M=37, D=96)]


def minimal_cost(shape: dict, elem_bytes: int, mode: str) -> tuple[int, int]:
    n = shape["M"] * shape["D"]
    per, fl = {"fwd": (3, 5), "bwd": (5, 10), "fwdbwd": (8, 15)}[mode]
    return per * n * elem_bytes, fl * n


def make_inputs(shape: dict, dtype, device, torch):
    M, D = shape["M"], shape["D"]
    return dict(x=(2.0 * torch.randn(M, D, device=device)).to(dtype), y=torch.randn(M, D, device=device, dtype=dtype))


def differentiable(inputs: dict) -> list:
    return [inputs["x"], inputs["y"]]


def reference(inputs: dict):
    return swiglu_reference(inputs["x"], inputs["y"])


def systems(torch):
    import tileport
    from tileport.dispatch import use_backend
    from tileport.bench import compiled_system

    def ours(backend):
        def run(inp):
            with use_backend(backend, op="swiglu"):
                return tileport.swiglu(inp["x"], inp["y"])

        return run

    def torch_eager(inp):
        return torch.nn.functional.silu(inp["x"]) * inp["y"]

    torch_compiled = compiled_system(torch, lambda x, y: torch.nn.functional.silu(x) * y, lambda inp: (inp["x"], inp["y"]))
    return {"triton": ours("triton"), "cutile": ours("cutile"), "reference": ours("reference"), "torch": torch_eager, "torch_compile": torch_compiled}
