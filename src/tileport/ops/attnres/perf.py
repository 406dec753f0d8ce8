"""AttnRes benchmark suite: shapes, the systems compared, and the minimal bytes and flops.

Minimal traffic (each input read once, each output written once), N tokens, L sources, D, e bytes:
    forward           (L + 1) * N * D * e          read L sources, write o
    backward          (2L + 1) * N * D * e         read L sources and do, write L gradients
    forward+backward  (3L + 2) * N * D * e
Flops are ~4 per element per source forward (dot, sum of squares, weighted sum) and ~10 backward:
at most a few GFLOP, 1000x under the matmul rate, so the floor is the bytes term.
"""

from __future__ import annotations

import contextlib
import os

from tileport.ops.attnres.reference import attnres_reference

STANDARD = [dict(L=8, N=16384, D=2048), dict(L=16, N=8192, D=4096), dict(L=4, N=32768, D=1024)]
SMALL = [dict(L=4, N=64, D=128), dict(L=3, N=37, D=96)]


def minimal_cost(shape: dict, elem_bytes: int, mode: str) -> tuple[int, int]:
    L, N, D = shape["L"], shape["N"], shape["D"]
    per = {"fwd": (L + 1, 4 * L), "bwd": (2 * L + 1, 10 * L), "fwdbwd": (3 * L + 2, 14 * L)}[mode]
    return per[0] * N * D * elem_bytes, per[1] * N * D


def make_inputs(shape: dict, dtype, device, torch):
    L, N, D = shape["L"], shape["N"], shape["D"]
    residuals = [torch.randn(N, D, device=device, dtype=dtype) for _ in range(L)]
    query = torch.randn(D, device=device) * (2.0 / D**0.5)
    rms_weight = 0.5 + torch.rand(D, device=device)
    return dict(query=query, residuals=residuals, rms_weight=rms_weight)


def differentiable(inputs: dict) -> list:
    return [inputs["query"], inputs["rms_weight"], *inputs["residuals"]]


def reference(inputs: dict):
    o, _ = attnres_reference(inputs["query"], inputs["residuals"], inputs["rms_weight"])
    return o


def systems(torch):
    """name -> callable(inputs) -> o; raising ImportError/NotImplementedError/RuntimeError marks a refusal."""
    import tileport
    from tileport.dispatch import use_backend

    def ours(backend):
        def run(inp):
            with use_backend(backend, op="attnres"):
                return tileport.fused_attnres(inp["query"], inp["residuals"], inp["rms_weight"])

        return run

    def fla(inp):
        from fla.ops.attnres import fused_attnres as fla_attnres

        return fla_attnres(inp["query"], inp["residuals"], inp["rms_weight"])

    def torch_eager(inp):
        # What a user would write without a fused kernel: stack, rms_norm, softmax, weighted sum (fp32 math).
        r = torch.stack(inp["residuals"]).float()
        k = torch.nn.functional.rms_norm(r, (r.shape[-1],), inp["rms_weight"].float(), 1e-6)
        p = torch.softmax(k @ inp["query"].float(), dim=0)
        return (p.unsqueeze(-1) * r).sum(0).to(inp["residuals"][0].dtype)

    return {"gluon": ours("gluon"), "triton": ours("triton"), "fla": fla, "torch": torch_eager,
            "gluon-devdesc": ours("gluon")}


@contextlib.contextmanager
def _gluon_device_descriptors():
    """Gluon with device-side TMA descriptors (TILEPORT_ATTNRES_DESC=device), forward and backward:
    the environment is process-wide, so autograd's backward thread sees it too."""
    from tileport.dispatch import use_backend

    before = os.environ.get("TILEPORT_ATTNRES_DESC")
    os.environ["TILEPORT_ATTNRES_DESC"] = "device"
    try:
        with use_backend("gluon", op="attnres"):
            yield
    finally:
        if before is None:
            del os.environ["TILEPORT_ATTNRES_DESC"]
        else:
            os.environ["TILEPORT_ATTNRES_DESC"] = before


# our backends run a second way, side by side with the default (see bench._forcing)
VARIANTS = {"gluon-devdesc": _gluon_device_descriptors}
