"""tandem._C.LoraLayer (sft/lora.h through the bindings) against PyTorch autograd in fp64.

The base weights are bf16 values, so the layer's BF16 packs hold them exactly and the fp64
reference uses the same weights; x is bf16. What differs is the layer's own rounding: h and
[dg du] rounded to bf16 before the base products (relative 2^-9 each, random signs) and dOut
rounded to bf16 for dOut Wd. Over these sizes that gives a relative L2 error of a few 1e-3
on every output (measured <= 3.5e-3); the bound is 1e-2. A wrong scaling, sign or missing
term is off by O(1). The C++ tests (tests/cpp/test_lora.cpp) check every format, subpool
split and layout element by element; this checks the bindings' plumbing.
"""
import pytest
import torch

from tandem import _C

E, H, I, K, T, R = 8, 128, 192, 2, 40, 8
BOUND = 1e-2


def spec(t):
    return (t.data_ptr(), t.numel(), 0, 0, False)


@pytest.fixture(scope="module")
def layer_and_weights():
    g = torch.Generator().manual_seed(20261121)
    pool = _C.Pool(config_text="cpu:\n  virtual_subpools: 2\n  threads: 1\n")
    layer = _C.LoraLayer(pool, E, H, I, rank=R, alpha=16.0, rslora=True)
    W = [(torch.randn(E, I, H, generator=g) / H**0.5 * 2).bfloat16(), (torch.randn(E, I, H, generator=g) / H**0.5 * 2).bfloat16(),
         (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()]
    layer.load([t.data_ptr() for t in W[0]], [t.data_ptr() for t in W[1]], [t.data_ptr() for t in W[2]], "bfloat16")
    return layer, W


def reference(W, P, x, ids, w, dout, s):
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    Pd = [p.double().requires_grad_() for p in P]
    ag, bg, au, bu, ad, bd = Pd
    out = torch.zeros(T, H, dtype=torch.float64)
    for e in range(E):
        tok, slot = torch.where(ids == e)
        if len(tok) == 0:
            continue
        xe = xd[tok]
        gg = xe @ W[0][e].double().T + s * (xe @ ag[e].T) @ bg[e].T
        u = xe @ W[1][e].double().T + s * (xe @ au[e].T) @ bu[e].T
        h = torch.nn.functional.silu(gg) * u
        y = h @ W[2][e].double().T + s * (h @ ad[e].T) @ bd[e].T
        out = out.index_add(0, tok, wd[tok, slot, None] * y)
    (out * dout.double()).sum().backward()
    return out.detach(), xd.grad, wd.grad, [p.grad for p in Pd]


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def test_forward_and_gradients_match_autograd(layer_and_weights):
    layer, W = layer_and_weights
    g = torch.Generator().manual_seed(7)
    shapes = layer.lora_shapes
    P = [torch.randn(E, r, c, generator=g) * 0.1 for r, c in shapes]
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[3, 0] = -1
    w = torch.rand(T, K, generator=g)
    dout = torch.randn(T, H, generator=g)
    out = torch.empty(T, H)
    ctx = layer.forward(x.data_ptr(), True, T, ids.data_ptr(), w.data_ptr(), K, out.data_ptr(), [spec(p) for p in P], True)
    assert ctx.valid and ctx.tokens == T and ctx.bytes > 0
    dx, dw = torch.empty(T, H), torch.empty(T, K)
    G = [torch.zeros_like(p) for p in P]
    layer.backward(ctx, [spec(p) for p in P], dout.data_ptr(), False, dx.data_ptr(), False, dw.data_ptr(), [spec(q) for q in G])
    assert not ctx.valid
    assert layer.scaling == pytest.approx(16.0 / R**0.5)
    ref_out, ref_dx, ref_dw, ref_G = reference(W, P, x, ids, w, dout, layer.scaling)
    errors = {"out": rel(out, ref_out), "dx": rel(dx, ref_dx), "dw": rel(dw, ref_dw)}
    for name, got, want in zip(["dA_gate", "dB_gate", "dA_up", "dB_up", "dA_down", "dB_down"], G, ref_G):
        errors[name] = rel(got, want)
    assert all(v < BOUND for v in errors.values()), errors
    assert dw[3, 0] == 0


def test_bad_buffers_and_contexts_are_refused(layer_and_weights):
    layer, _ = layer_and_weights
    shapes = layer.lora_shapes
    P = [torch.zeros(E, r, c) for r, c in shapes]
    P_bad = list(P)
    P_bad[0] = torch.zeros(E, R * 2, H)  # a_gate sized for rank 16
    x = torch.zeros(T, H)
    ids = torch.zeros(T, K, dtype=torch.int64)
    w = torch.ones(T, K)
    out = torch.full((T, H), 7.0)
    with pytest.raises(ValueError, match="a_gate"):
        layer.forward(x.data_ptr(), False, T, ids.data_ptr(), w.data_ptr(), K, out.data_ptr(), [spec(p) for p in P_bad], True)
    assert bool((out == 7.0).all())
    ctx = layer.forward(x.data_ptr(), False, T, ids.data_ptr(), w.data_ptr(), K, out.data_ptr(), [spec(p) for p in P], True)
    dx = torch.empty(T, H)
    args = ([spec(p) for p in P], torch.zeros(T, H).data_ptr(), False, dx.data_ptr(), False, 0, [])
    layer.backward(ctx, *args)
    with pytest.raises(ValueError, match="already used"):
        layer.backward(ctx, *args)
