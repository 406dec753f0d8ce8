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

Both paths carry the forward's forced backends (`tileport.use_backend`, thread-local) to the
backward: autograd runs the backward of CUDA tensors on its own device thread, where they would
be absent and the backward would dispatch to the default backend (seen on the H200, 2026-11-30:
the bench's "triton" backward rows timed gluon's backward). Under torch.compile the op's backward
function runs once, when AOTAutograd traces it: the backward custom op it records runs later on
that device thread, so a backward op that dispatches takes them as a string argument
(`forced_backends_arg(ctx)`, a constant in the traced graph: the settings in force when the graph
was traced) and runs under `backends_forced_from(arg)` (seen on the H200, 2026-12-02: KDA's
compiled backward under use_backend("triton") ran the gluon backend's). The forward custom op
dispatches at each call, under the caller's settings, and neither torch.compile nor its caches
guard on them: a compiled function called under other `use_backend` settings than it was traced
under runs its forward on those and its backward on the traced ones (torch._dynamo.reset() after
changing them, to trace again).
"""

from __future__ import annotations

import functools
import json

import torch

from tileport.dispatch import backends_forced_as, forced_backends

_FORCED = "_tileport_forced_backends"


def forced_backends_arg(ctx) -> str:
    """The forced backends `setup_context` recorded in ctx, as a backward custom op's str argument."""
    return json.dumps(sorted(getattr(ctx, _FORCED, {}).items()))


def backends_forced_from(arg: str):
    """Context manager: run the block under the forced backends `forced_backends_arg` encoded."""
    return backends_forced_as(dict(json.loads(arg)))


def carrying_forced_backends(setup_context, backward):
    """(setup_context, backward) that also record the forward thread's forced backends in ctx and
    run the backward under them."""

    @functools.wraps(setup_context)
    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        setattr(ctx, _FORCED, forced_backends())

    @functools.wraps(backward)
    def run_backward(ctx, *grads, **kwargs):
        with backends_forced_as(getattr(ctx, _FORCED, {})):
            return backward(ctx, *grads, **kwargs)

    return setup, run_backward


def register_autograd(op_name: str, backward, setup_context) -> None:
    """torch.library.register_autograd, with the forced backends carried to the backward."""
    setup, run_backward = carrying_forced_backends(setup_context, backward)
    torch.library.register_autograd(op_name, run_backward, setup_context=setup)


def carries_forced_backends(cls):
    """Class decorator for an autograd.Function with its own forward(ctx, ...) / backward(ctx, ...):
    the forward records this thread's forced backends, the backward runs under them."""
    forward, backward = cls.forward, cls.backward

    @functools.wraps(forward)
    def _forward(ctx, *args, **kwargs):
        setattr(ctx, _FORCED, forced_backends())
        return forward(ctx, *args, **kwargs)

    @functools.wraps(backward)
    def _backward(ctx, *grads):
        with backends_forced_as(getattr(ctx, _FORCED, {})):
            return backward(ctx, *grads)

    cls.forward, cls.backward = staticmethod(_forward), staticmethod(_backward)
    return cls


def eager_function(name: str, forward_body, backward_body, setup_context, backward, keeps: bool = False):
    """An autograd.Function class whose apply(*inputs) runs forward_body(*inputs). With keeps,
    forward_body returns (outputs, kept) and `kept` (what the forward formed that its backward
    reuses instead of recomputing: eager mode only, a custom op's outputs are its schema's) is
    set as ctx.kept before setup_context runs, which saves it (ctx.save_for_backward) for the
    op's backward."""

    setup, run_backward = carrying_forced_backends(setup_context, backward)

    def _forward(ctx, *inputs):
        out = forward_body(*inputs)
        if keeps:
            out, ctx.kept = out
        setup(ctx, inputs, out)
        return out

    def _backward(ctx, *grads):
        return run_backward(ctx, *grads, backward_op=backward_body)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(_forward),
        "backward": staticmethod(_backward),
    })
