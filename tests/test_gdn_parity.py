"""Gated DeltaNet parity gate: every backend against the float64 recurrence, forward and backward.

Frozen contract: kernel work never edits this file or reference.py. Inputs are fresh random draws
(never zeros), outputs and every buffer tileport allocates start as NaN, and shapes are ragged on
purpose (T = 1, 63, 65, 200; varlen with a length-1 and a length-0 sequence; K = V = 64 and 128 and
an odd pair). Backends this machine can't run are skipped with the reason.

Gradients are checked against autograd through `gdn_reference` (the step-by-step recurrence), for
q, k, v, g, beta and the initial state, with upstream gradients on both o and the final state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tileport
from tileport.ops.gdn import DISPATCHER, _triton_refusal, explain_call
from tileport.ops.gdn.reference import chunked_reference, gdn_reference
from tileport.testing import GATE, OUTPUT, backend_skip_reason, check, on_gpu, poisoned, use_backend

BACKENDS = ["reference", "triton"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _one_thread():
    # The reference is a loop of tiny ops; with intra-op threads on a small, busy CPU each op can
    # wait on a descheduled thread (100x slower). One thread keeps the gate fast; restored after.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _backend_or_skip(name: str, device: str):
    reason = backend_skip_reason("gdn", name, device.split(":")[0])
    if reason:
        pytest.skip(f"{name}: {reason}")


# id: (B, T, H, K, V, dtype, cu_seqlens, initial_state, l2norm, gates, beta, scale)
#   gates: "normal" logsigmoid(randn); "near0" in (-1e-3, 0]; "mixed" 30% of steps at -20..-30;
#          "verynegative" every step at -20..-30.   beta: "rand" in (0, 1); "binary" exactly 0 or 1.
CASES = {
    "T1-bf16": (2, 1, 2, 64, 64, "bf16", None, True, False, "normal", "rand", None),
    "T63-fp32-l2": (1, 63, 1, 64, 64, "fp32", None, False, True, "normal", "rand", None),
    "T65-bf16-l2-near0": (1, 65, 2, 64, 64, "bf16", None, True, True, "near0", "rand", 0.2),
    "T200-bf16-mixedgates-binarybeta": (1, 200, 2, 64, 64, "bf16", None, True, False, "mixed", "binary", None),
    "B2-T130-fp32-l2": (2, 130, 1, 64, 64, "fp32", None, True, True, "normal", "rand", None),
    "varlen-bf16-l2": (1, 200, 2, 64, 64, "bf16", [0, 1, 70, 70, 200], True, True, "normal", "rand", None),
    "varlen-fp32-near0-binarybeta": (1, 129, 1, 64, 64, "fp32", [0, 63, 64, 129], False, False, "near0", "binary", None),
    "T100-fp16-verynegative": (1, 100, 1, 64, 64, "fp16", None, True, False, "verynegative", "rand", None),
    "K128-bf16-l2": (1, 65, 1, 128, 128, "bf16", None, True, True, "normal", "rand", None),
    "K48-V80-fp32": (1, 70, 1, 48, 80, "fp32", None, True, False, "mixed", "rand", None),
}
# On a GPU, also many chunks and programs at once (too slow for the CPU interpreter).
GPU_CASES = {
    "gpu-B2-T1000-H4-K128-bf16-l2": (2, 1000, 4, 128, 128, "bf16", None, True, True, "normal", "rand", None),
    "gpu-varlen-T1500-H4-K128-bf16": (1, 1500, 4, 128, 128, "bf16", [0, 1, 64, 65, 300, 700, 701, 1500], True, False,
                                      "mixed", "binary", None),
    "gpu-B3-T777-fp16-l2-near0": (3, 777, 2, 64, 64, "fp16", None, False, True, "near0", "rand", None),
    "gpu-B2-T500-K128-fp32": (2, 500, 2, 128, 128, "fp32", None, True, False, "verynegative", "rand", None),
    # K = V = 32 in 16 bits, which no case here had on a GPU: KDA's tile solve faulted at that shape
    # on the H200 (7e672c1; docs/perf/kda.md row 11), GDN's ran there only in a probe
    "gpu-varlen-T330-H2-K32-bf16-l2": (1, 330, 2, 32, 32, "bf16", [0, 1, 70, 70, 200, 330], True, True, "mixed",
                                       "rand", None),
}
if on_gpu():
    CASES.update(GPU_CASES)


def make_inputs(B, T, H, K, V, dtype, cu, with_h0, l2, gates, beta_kind, device):
    """Fresh random GDN inputs. Without in-kernel l2norm, k is normalised here (as FLA's users do:
    the delta rule needs |k| <= 1 to stay stable)."""
    q = torch.randn(B, T, H, K, device=device)
    k = torch.randn(B, T, H, K, device=device)
    if not l2:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, device=device)
    g = F.logsigmoid(torch.randn(B, T, H, device=device))
    if gates == "near0":
        g = -1e-3 * torch.rand(B, T, H, device=device)
    elif gates == "mixed":
        g = torch.where(torch.rand(B, T, H, device=device) < 0.3, -20.0 - 10.0 * torch.rand(B, T, H, device=device), g)
    elif gates == "verynegative":
        g = -20.0 - 10.0 * torch.rand(B, T, H, device=device)
    if beta_kind == "binary":
        beta = torch.randint(0, 2, (B, T, H), device=device).float()
    else:
        beta = torch.rand(B, T, H, device=device)
    N = B if cu is None else len(cu) - 1
    h0 = 0.5 * torch.randn(N, H, K, V, device=device) if with_h0 else None
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    # q, k, v (and beta, half the time) in the input dtype; g stays fp32, as FLA's callers pass it
    beta_dtype = dtype if (T % 2) else torch.float32
    return (q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(beta_dtype), h0, cu_t)


def _run_and_check(backend, case_id, device, seed):
    B, T, H, K, V, dt, cu, with_h0, l2, gates, beta_kind, scale = CASES[case_id]
    dtype = DTYPES[dt]
    q, k, v, g, beta, h0, cu_t = make_inputs(B, T, H, K, V, dtype, cu, with_h0, l2, gates, beta_kind, device)
    leaves = [q, k, v, g, beta] + ([h0] if h0 is not None else [])
    for t in leaves:
        t.requires_grad_(True)

    with poisoned(), use_backend(backend, op="gdn"):
        o, ht = tileport.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_t)
        do = torch.randn_like(o)
        dht = torch.randn_like(ht)
        grads = torch.autograd.grad([o, ht], leaves, [do, dht])

    ref_o, ref_ht = gdn_reference(q, k, v, g, beta, scale, h0, True, l2, cu_t)
    ref_grads = torch.autograd.grad([ref_o, ref_ht], leaves, [do.double(), dht.double()])

    where = f"[backend={backend} case={case_id} seed={seed}]"
    N = B if cu is None else len(cu) - 1
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    assert ht.dtype == torch.float32 and ht.shape == (N, H, K, V)
    check(f"o {where}", o, ref_o, dtype)
    check(f"final_state {where}", ht, ref_ht, dtype)
    names = ["dq", "dk", "dv", "dg", "dbeta", "d initial_state"]
    kinds = [OUTPUT, OUTPUT, OUTPUT, GATE, GATE, OUTPUT]
    for name, kind, gr, rg, leaf in zip(names, kinds, grads, ref_grads, leaves):
        assert gr.dtype == leaf.dtype and gr.shape == leaf.shape, name
        check(f"{name} {where}", gr, rg, dtype, kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case_id", list(CASES))
def test_forward_backward(backend, case_id, device, seed):
    _backend_or_skip(backend, device)
    _run_and_check(backend, case_id, device, seed)


@pytest.mark.parametrize("cfg", [
    dict(B=2, T=200, cu=None, l2=False, h0=True, gates="normal"),
    dict(B=1, T=200, cu=[0, 1, 64, 64, 130, 200], l2=True, h0=True, gates="mixed"),
    dict(B=1, T=65, cu=None, l2=False, h0=False, gates="verynegative"),
], ids=["B2-T200", "varlen-l2-mixed", "T65-verynegative"])
def test_chunked_reference_matches_recurrence(cfg, seed):
    """The chunk algebra the kernels implement (reference.chunked_reference) equals the recurrence."""
    B, T, H, K, V = cfg["B"], cfg["T"], 2, 32, 24
    q, k, v, g, beta, h0, cu = make_inputs(B, T, H, K, V, torch.float64, cfg["cu"], cfg["h0"], cfg["l2"], cfg["gates"],
                                           "rand", "cpu")
    o, ht = chunked_reference(q, k, v, g, beta, 0.3, h0, True, cfg["l2"], cu)
    ref_o, ref_ht = gdn_reference(q, k, v, g, beta, 0.3, h0, True, cfg["l2"], cu)
    check(f"chunked o [seed={seed}]", o, ref_o, torch.float64)
    check(f"chunked final_state [seed={seed}]", ht, ref_ht, torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_defaults_no_final_state_non_contiguous(backend, device, seed):
    """Default scale, output_final_state=False (returns None; only o carries gradient), and q/k/v
    given as strided views of [B, H, T, D] tensors."""
    _backend_or_skip(backend, device)
    B, T, H, K, V = 1, 70, 2, 64, 64
    q = torch.randn(B, H, T, K, device=device).transpose(1, 2)
    k = F.normalize(torch.randn(B, H, T, K, device=device), dim=-1).transpose(1, 2)
    v = torch.randn(B, H, T, V, device=device).transpose(1, 2)
    g = F.logsigmoid(torch.randn(B, T, H, device=device))
    beta = torch.rand(B, T, H, device=device)
    leaves = [q, k, v, g, beta]
    for t in leaves:
        t.requires_grad_(True)
    with poisoned(), use_backend(backend, op="gdn"):
        o, ht = tileport.chunk_gated_delta_rule(q, k, v, g, beta)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, leaves, do)
    assert ht is None
    ref_o, _ = gdn_reference(q, k, v, g, beta)
    ref_grads = torch.autograd.grad(ref_o, leaves, do.double())
    check(f"o [backend={backend} seed={seed}]", o, ref_o, torch.float32)
    for name, gr, rg in zip(["dq", "dk", "dv", "dg", "dbeta"], grads, ref_grads):
        check(f"{name} [backend={backend} seed={seed}]", gr, rg, torch.float32, GATE if name in ("dg", "dbeta") else OUTPUT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequence_axis(backend, device):
    """T = 0: o is empty, the final state is the initial state, and its gradient passes through."""
    _backend_or_skip(backend, device)
    B, H, K, V = 2, 1, 64, 64
    q = torch.randn(B, 0, H, K, device=device)
    v = torch.randn(B, 0, H, V, device=device)
    g = torch.zeros(B, 0, H, device=device)
    h0 = torch.randn(B, H, K, V, device=device, requires_grad=True)
    with use_backend(backend, op="gdn"):
        o, ht = tileport.chunk_gated_delta_rule(q, q, v, g, g, initial_state=h0, output_final_state=True)
        dht = torch.randn_like(ht)
        (dh0,) = torch.autograd.grad(ht, [h0], dht)
    assert o.shape == (B, 0, H, V)
    assert torch.equal(ht, h0.detach()) and torch.equal(dh0, dht)


def test_explain_lists_both_backends():
    call = explain_call("8,4096,16,128,128", torch.bfloat16, "cuda", (9, 0))
    assert (call.K, call.V) == (128, 128)
    text = DISPATCHER.explain(call, "cuda")
    assert "triton" in text and "reference" in text
    big = explain_call("1,64,1,256,64", torch.bfloat16, "cuda", (9, 0))
    assert "head-dim cap" in _triton_refusal(big)
    assert "kernel dtype" in _triton_refusal(explain_call("1,64,1,64,64", torch.float64, "cuda", (9, 0)))
    with pytest.raises(ValueError, match="B,T,H,K,V"):
        explain_call("8,4096,16", torch.bfloat16, "cuda", (9, 0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_op_opcheck(backend, device):
    """tileport::gdn_forward passes torch.library.opcheck: schema, fake tensor, autograd registration."""
    _backend_or_skip(backend, device)
    q, k, v, g, beta, h0, cu = make_inputs(1, 20, 1, 16, 16, torch.float32, [0, 7, 20], True, False, "normal", "rand", device)
    for t in (q, k, v, g, beta, h0):
        t.requires_grad_(True)
    with use_backend(backend, op="gdn"):
        torch.library.opcheck(torch.ops.tileport.gdn_forward.default, (q, k, v, g, beta, h0, cu, 0.25, True, False))


# Issue 4's full sizes (SPEC's S1 and the long sequence), GPU only. The float64 step recurrence
# with autograd would keep T states of [H, K, V] alive (tens of GB at T = 32768), so these use the
# float64 chunked form as the reference, which test_chunked_reference_matches_recurrence ties to
# the recurrence (to ~1e-16) on every run.
FULL_SIZE = {
    "S1-B8-T4096-H16-K128-bf16-l2": (8, 4096, 16, 128, 128, None),
    "long-B1-T32768-H16-K128-bf16-l2": (1, 32768, 16, 128, 128, None),
    "varlen-T8192-H16-K128-bf16-l2": (1, 8192, 16, 128, 128, [0, 1, 100, 2049, 4096, 4097, 8192]),
}


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("case_id", list(FULL_SIZE))
def test_full_size_against_chunked_reference(backend, case_id, device, seed):
    if not on_gpu():
        pytest.skip("full-size GDN parity runs on a GPU (scripts/gpu-check)")
    _backend_or_skip(backend, device)
    B, T, H, K, V, cu = FULL_SIZE[case_id]
    dtype = torch.bfloat16
    q, k, v, g, beta, h0, cu_t = make_inputs(B, T, H, K, V, dtype, cu, True, True, "mixed", "rand", device)
    leaves = [q, k, v, g, beta, h0]
    for t in leaves:
        t.requires_grad_(True)
    with poisoned(), use_backend(backend, op="gdn"):
        o, ht = tileport.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t)
        do, dht = torch.randn_like(o), torch.randn_like(ht)
        grads = torch.autograd.grad([o, ht], leaves, [do, dht])
    ref_o, ref_ht = chunked_reference(q, k, v, g, beta, None, h0, True, True, cu_t)
    ref_grads = torch.autograd.grad([ref_o, ref_ht], leaves, [do.double(), dht.double()])
    where = f"[backend={backend} case={case_id} seed={seed}]"
    check(f"o {where}", o, ref_o, dtype)
    check(f"final_state {where}", ht, ref_ht, dtype)
    for name, kind, gr, rg in zip(["dq", "dk", "dv", "dg", "dbeta", "d initial_state"],
                                  [OUTPUT, OUTPUT, OUTPUT, GATE, GATE, OUTPUT], grads, ref_grads):
        check(f"{name} {where}", gr, rg, dtype, kind)


def test_torch_compile_fullgraph_matches_eager(device, seed):
    """Under torch.compile the op runs as the tileport::gdn_* custom ops (fake impls, registered
    autograd); eagerly it runs the same bodies in an autograd.Function. Both must agree."""
    B, T, H, K, V = 1, 70, 2, 64, 64
    q, k, v, g, beta, h0, _ = make_inputs(B, T, H, K, V, torch.float32, None, True, True, "normal", "rand", device)
    leaves = [q, k, v, g, beta, h0]
    for t in leaves:
        t.requires_grad_(True)

    def f(q, k, v, g, beta, h0):
        o, ht = tileport.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
        return o.sum() + ht.square().sum()

    eager = f(*leaves)
    g_eager = torch.autograd.grad(eager, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    g_comp = torch.autograd.grad(compiled, leaves)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
