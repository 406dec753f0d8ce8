"""One op body, two autograd paths: the eager path and the torch.compile path.

Each op's forward and backward bodies are plain functions. Under torch.compile they run inside
torch.library custom ops (opaque to the compiler, with fake implementations, autograd registered
with `torch.library.register_autograd`). In eager mode `eager_function` runs the same bodies in an
autograd.Function, skipping torch.library's per-call checks: they cost tens of microseconds a call,
and torch 2.11's output-aliasing check raised on CUDA for an op body that was correct (AttnRes,
on the H200, 2026-11-29).

`setup_context(ctx, inputs, output)` and `backward(ctx, *grads, backward_op=...)` are the op's
own functions, shared by both paths; `backward_op` is the backward body in eager mode and the
backward custom op under compile.
"""

from __future__ import annotations

import torch


def eager_function(name: str, forward_body, backward_body, setup_context, backward):
    """An autograd.Function class whose apply(*inputs) runs forward_body(*inputs)."""

    def _forward(ctx, *inputs):
        out = forward_body(*inputs)
        setup_context(ctx, inputs, out)
        return out

    def _backward(ctx, *grads):
        return backward(ctx, *grads, backward_op=backward_body)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(_forward),
        "backward": staticmethod(_backward),
    })
