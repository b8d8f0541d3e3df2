"""Interop: torch / JAX / DLPack arrays at the public entry points without copies, results in
the caller's library; the tiga_numba.torch adapter's gradients against torch (SDPA, autograd,
gradcheck in float64, PyG's layers)."""
import subprocess
import sys

import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba import interop

torch = pytest.importorskip("torch")


def _ptr(a):
    return a.__array_interface__["data"][0]


def test_package_import_does_not_import_torch():
    code = ("import sys, numpy as np, tiga_numba as tg, tiga_numba.layers, tiga_numba.interop\n"
            "g = tg.Graph.dense(3)\n"
            "q = np.ones((3, 1, 2), np.float32)\n"
            "tg.attention(q, q, q, g)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'jax' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_dlpack_views_share_memory_both_ways():
    t = torch.randn(5, 2, 3)
    a = interop.to_native(t)
    assert isinstance(a, np.ndarray) and _ptr(a) == t.data_ptr()
    t_req = torch.randn(4, 3, requires_grad=True)
    assert _ptr(interop.to_native(t_req)) == t_req.data_ptr()  # detached view, no copy
    back = interop.to_library(a, "torch")
    assert isinstance(back, torch.Tensor) and back.data_ptr() == _ptr(a)
    a[0, 0, 0] = 42.0  # one buffer: visible through the tensor
    assert float(t[0, 0, 0]) == 42.0
    strided = torch.randn(6, 4)[:, ::2]  # non-contiguous: a strided view, still no copy
    v = interop.to_native(strided)
    np.testing.assert_array_equal(v, strided.numpy())
    assert _ptr(v) == strided.data_ptr()


def test_attention_and_backward_take_and_return_torch_tensors():
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.normal(size=(9, 2, 4)).astype(np.float32))
    k = torch.from_numpy(rng.normal(size=(11, 1, 4)).astype(np.float32))
    v = torch.from_numpy(rng.normal(size=(11, 1, 3)).astype(np.float32))
    g = tg.Graph.from_coo(rng.integers(0, 11, 40), rng.integers(0, 9, 40), 11, 9)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    assert isinstance(out, torch.Tensor) and isinstance(stats.m, torch.Tensor)
    ref, ref_stats = tg.attention(q.numpy(), k.numpy(), v.numpy(), g, return_stats=True)
    np.testing.assert_array_equal(out.numpy(), ref)
    dout = torch.randn_like(out)
    grads = tg.attention_backward(dout, q, k, v, out, stats, g)
    ref_grads = tg.attention_backward(dout.numpy(), q.numpy(), k.numpy(), v.numpy(), ref,
                                      ref_stats, g)
    for a, b in zip(grads, ref_grads):
        assert isinstance(a, torch.Tensor)
        np.testing.assert_array_equal(a.numpy(), b)


def test_stats_lse_and_merge_take_and_return_torch_tensors():
    """stats.lse of a torch call and attention_merge of torch parts come back as torch tensors,
    equal to the numpy results; the merged stats feed attention_backward."""
    rng = np.random.default_rng(1)
    n = 13
    q, k, v, do = (rng.normal(size=(n, 2, 4)).astype(np.float32) for _ in range(4))
    lo, hi = tg.Graph.band(n, left=None, right=-3), tg.Graph.band(n, left=2, right=0)   # disjoint
    full = tg.Graph.triangular(n)
    parts_np = [tg.attention(q, k, v, g, return_stats=True) for g in (lo, hi)]
    tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, do))
    parts_t = [tg.attention(tq, tk, tv, g, return_stats=True) for g in (lo, hi)]
    lse = parts_t[0][1].lse
    assert isinstance(lse, torch.Tensor)
    np.testing.assert_array_equal(lse.numpy(), parts_np[0][1].lse)
    assert np.isneginf(lse.numpy()[:3]).all()           # rows 0-2 have no edge in `lo`
    out_t, st_t = tg.attention_merge(parts_t)
    out_n, st_n = tg.attention_merge(iter(parts_np))
    assert isinstance(out_t, torch.Tensor) and isinstance(st_t.m, torch.Tensor)
    assert isinstance(st_t.lse, torch.Tensor)
    np.testing.assert_array_equal(out_t.numpy(), out_n)
    np.testing.assert_array_equal(st_t.lse.numpy(), st_n.lse)
    np.testing.assert_allclose(out_n, tg.attention(q, k, v, full), rtol=1e-5, atol=1e-6)
    grads = tg.attention_backward(tdo, tq, tk, tv, out_t, st_t, full)
    want = tg.attention_backward(do, q, k, v, out_n, st_n, full)
    for a, b in zip(grads, want):
        assert isinstance(a, torch.Tensor)
        np.testing.assert_array_equal(a.numpy(), b)
    with pytest.raises(TypeError, match="parts\\[0\\] out"):
        tg.attention_merge([([1.0, 2.0], parts_np[0][1])])


def test_program_and_layer_take_torch_tensors():
    from tiga_numba.layers import GATConv

    class Full(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, scale):
            return self.reducer((src.key * dst.query).sum(axis=-1) * scale, src.value)

    q = torch.randn(6, 2, 4)
    g = tg.Graph.dense(6)
    prog = Full()
    out, vjp = prog.vjp(graph=g, src={"key": q, "value": q}, dst={"query": q}, scale=0.5)
    assert isinstance(out, torch.Tensor)
    grads = vjp(torch.ones_like(out))
    assert isinstance(grads["dst"]["query"], torch.Tensor)
    ref = prog(graph=g, src={"key": q.numpy(), "value": q.numpy()}, dst={"query": q.numpy()},
               scale=0.5)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6)

    conv = GATConv(4, 3, heads=2, seed=0)
    x = torch.randn(6, 4)
    out, vjp = conv.vjp(x, g)
    assert isinstance(out, torch.Tensor)
    grads = vjp(torch.ones_like(out))
    assert isinstance(grads["x"], torch.Tensor) and isinstance(grads["params"]["lin.weight"], torch.Tensor)
    np.testing.assert_allclose(out.numpy(), conv(x.numpy(), g), rtol=1e-6)
    conv.load_state_dict({k: torch.from_numpy(v) for k, v in conv.state_dict().items()})


def test_jax_arrays_round_trip():
    jnp = pytest.importorskip("jax.numpy")
    q = jnp.asarray(np.random.default_rng(1).normal(size=(5, 1, 4)).astype(np.float32))
    g = tg.Graph.triangular(5)
    out = tg.attention(q, q, q, g)
    assert type(out).__module__.startswith("jax")
    # jax's default device may be a GPU: then the CUDA kernels ran, and float32 sums in another
    # order than the CPU kernels' differ in the last bits
    np.testing.assert_allclose(np.asarray(out), tg.attention(np.asarray(q), np.asarray(q),
                                                             np.asarray(q), g), rtol=1e-5, atol=1e-6)


def test_foreign_dtype_is_refused_by_name():
    with pytest.raises(TypeError, match="q"):
        tg.attention(torch.ones(3, 1, 2, dtype=torch.bfloat16), torch.ones(3, 1, 2),
                     torch.ones(3, 1, 2), tg.Graph.dense(3))


# --------------------------------------------------------------------------- the adapter
def _sdpa_layout(x):
    return x.permute(1, 0, 2).unsqueeze(0)  # (N, H, D) -> (1, H, N, D)


@pytest.mark.parametrize("causal", [False, True])
def test_adapter_attention_gradients_match_torch_sdpa(causal):
    import tiga_numba.torch as tgt
    gen = torch.Generator().manual_seed(int(causal))
    n, h, d = 33, 2, 8
    q, k, v = (torch.randn(n, h, d, generator=gen, requires_grad=True) for _ in range(3))
    g = tg.Graph.triangular(n) if causal else tg.Graph.dense(n)
    out = tgt.attention(q, k, v, g)
    dout = torch.randn(n, h, d, generator=gen)
    out.backward(dout)
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = torch.nn.functional.scaled_dot_product_attention(
        _sdpa_layout(q), _sdpa_layout(k), _sdpa_layout(v), is_causal=causal)
    ref = ref.squeeze(0).permute(1, 0, 2)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, t in zip(ours, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-5)


def test_adapter_gradcheck_float64():
    import tiga_numba.torch as tgt
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, 7, (20,), generator=gen)
    dst = torch.randint(0, 5, (20,), generator=gen)
    g = tg.Graph.from_coo(src.numpy(), dst.numpy(), 7, 5)
    q = torch.randn(5, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(7, 1, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(7, 1, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: tgt.attention(a, b, c, g), (q, k, v))
    ei = torch.stack([src, dst % 7])
    for cls, kw in ((tgt.GATConv, dict(heads=2, edge_dim=2)),
                    (tgt.GATv2Conv, dict(heads=2, edge_dim=2)),
                    (tgt.TransformerConv, dict(heads=2, edge_dim=2, beta=True))):
        conv = cls(3, 2, **kw).double()
        x = torch.randn(7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
        ea = torch.randn(20, 2, dtype=torch.float64, generator=gen, requires_grad=True)
        assert torch.autograd.gradcheck(lambda a, b: conv(a, ei, b), (x, ea)), cls.__name__
        names = [name for name, _ in conv.named_parameters()]

        def of_params(*ws, conv=conv, names=names, x=x, ea=ea):
            return torch.func.functional_call(conv, dict(zip(names, ws)), (x.detach(), ei, ea.detach()))
        ws = tuple(p.detach().clone().requires_grad_(True) for p in conv.parameters())
        assert torch.autograd.gradcheck(of_params, ws), cls.__name__


def _flash_oracle(q, k, v, slopes, cap):
    """torch float64 attention with flash-attn's soft-cap and ALiBi on a causal square relation
    (grouped-query heads: kv head h // (H // Hkv)), default scale."""
    N, H, D = q.shape
    group = H // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = cap * torch.tanh(torch.einsum("ihd,jhd->hij", q, kk) * D ** -0.5 / cap)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    s = (s - slopes[:, None, None] * (i - j).abs()).masked_fill(j > i, -torch.inf)
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)


def test_adapter_attention_takes_softcap_and_alibi_slopes():
    """tgt.attention with flash-attn's modifiers against autograd of a float64 torch oracle,
    gradients of q, k, v and of the slopes (which require grad); GQA, a causal relation."""
    import tiga_numba.torch as tgt
    gen = torch.Generator().manual_seed(5)
    N, H, Hkv, D, cap = 29, 4, 2, 8, 1.5
    g = tg.Graph.triangular(N)
    q = torch.randn(N, H, D, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(N, Hkv, D, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    slopes = torch.rand(H, dtype=torch.float64, generator=gen).requires_grad_()

    out = tgt.attention(q, k, v, g, softcap=cap, alibi_slopes=slopes)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    ours = torch.autograd.grad(out, (q, k, v, slopes), dout)
    ref_out = _flash_oracle(q, k, v, slopes, cap)
    theirs = torch.autograd.grad(ref_out, (q, k, v, slopes), dout)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    # flash-attn's (1, H) slopes: the same call, their gradient in their shape
    slopes_1h = slopes.detach()[None].clone().requires_grad_()
    out_1h = tgt.attention(q, k, v, g, softcap=cap, alibi_slopes=slopes_1h)
    d_1h = torch.autograd.grad(out_1h, slopes_1h, dout)[0]
    assert torch.equal(out_1h, out) and d_1h.shape == (1, H) and torch.equal(d_1h[0], ours[3])
    # slopes that need no gradient, a 0-d tensor soft-cap, float32
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o32 = tgt.attention(q32, k32, v32, g, softcap=torch.tensor(cap), alibi_slopes=slopes.detach().float())
    o32.backward(dout.float())
    torch.testing.assert_close(o32.double(), ref_out.detach(), rtol=0, atol=2e-6)
    assert q32.grad is not None and q32.grad.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="softcap"):
        tgt.attention(q, k, v, g, softcap=torch.tensor(cap, requires_grad=True))
    with pytest.raises(TypeError, match="alibi_slopes"):
        tgt.attention(q, k, v, g, alibi_slopes=np.ones(H))


def test_adapter_per_sequence_alibi_slopes_and_their_gradient():
    """flash-attn's (batch, H) slopes on a cu_seqlens relation (one sequence empty): sequence b
    takes slopes[b]; out and every gradient, the slopes' (batch, H) one included, against the
    float64 oracle of each sequence on its own."""
    import tiga_numba.torch as tgt
    gen = torch.Generator().manual_seed(6)
    cu, H, Hkv, D, cap = [0, 9, 9, 20], 4, 2, 8, 2.0
    g = tg.Graph.cu_seqlens(np.array(cu), causal=True)
    q = torch.randn(20, H, D, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(20, Hkv, D, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    slopes = torch.rand(3, H, dtype=torch.float64, generator=gen).requires_grad_()
    out = tgt.attention(q, k, v, g, softcap=cap, alibi_slopes=slopes)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    ours = torch.autograd.grad(out, (q, k, v, slopes), dout)
    ref_out = torch.cat([_flash_oracle(q[a:b], k[a:b], v[a:b], slopes[i], cap)
                         for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])) if b > a])
    theirs = torch.autograd.grad(ref_out, (q, k, v, slopes), dout)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert ours[3].shape == (3, H) and not ours[3][1].any()   # the empty sequence's slopes: 0
    # a call with nothing to reduce (no keys): zero gradients, the slopes' in their shape
    keyless = tg.Graph.cu_seqlens(np.array([0, 3, 5]), cu_seqlens_k=np.array([0, 0, 0]))
    s2 = slopes.detach()[:2].clone().requires_grad_()
    q2 = q.detach()[:5].clone().requires_grad_()
    out2 = tgt.attention(q2, k[:0], v[:0], keyless, alibi_slopes=s2)
    out2.backward(torch.ones_like(out2))
    assert s2.grad.shape == (2, H) and not s2.grad.any() and not q2.grad.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, slopes_grad, tol", [(torch.float32, True, 3e-5), (torch.float16, False, 2e-2)])
def test_adapter_attention_modifiers_on_cuda_tensors(cupy_gpu, dtype, slopes_grad, tol):
    """tgt.attention's softcap= / alibi_slopes= on CUDA tensors (float32: the CUDA-core kernels,
    which also give the slopes' gradient; float16: the tensor-core kernels) against autograd of a
    float64 oracle on the host; causal, GQA, rows that are no multiple of a tile."""
    import tiga_numba.torch as tgt
    gen = torch.Generator().manual_seed(11)
    N, H, Hkv, D, cap = 157, 4, 2, 64, 5.0
    g = tg.Graph.triangular(N)
    q64 = torch.randn(N, H, D, dtype=torch.float64, generator=gen)
    k64, v64 = (torch.randn(N, Hkv, D, dtype=torch.float64, generator=gen) for _ in range(2))
    s64 = torch.rand(H, dtype=torch.float64, generator=gen) * 0.2
    dout64 = torch.randn(N, H, D, dtype=torch.float64, generator=gen)
    # the oracle runs on the inputs the device sees (rounded to dtype)
    q64, k64, v64 = (t.to(dtype).double().requires_grad_() for t in (q64, k64, v64))
    s64 = s64.float().double().requires_grad_()

    ref = _flash_oracle(q64, k64, v64, s64, cap)
    want = torch.autograd.grad(ref, (q64, k64, v64, s64), dout64)
    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in (q64, k64, v64))
    slopes = s64.detach().to("cuda", torch.float32).requires_grad_(slopes_grad)
    out = tgt.attention(q, k, v, g, softcap=cap, alibi_slopes=slopes)
    assert out.is_cuda and out.dtype == dtype
    out.backward(dout64.to("cuda", dtype))
    got = [q.grad, k.grad, v.grad] + ([slopes.grad] if slopes_grad else [])
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=0, atol=tol)
    for a, b in zip(got, want):
        assert a is not None and a.is_cuda
        scale = float(b.abs().max())
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=tol * max(1.0, scale))
    if not slopes_grad:
        assert slopes.grad is None


@pytest.mark.gpu
def test_adapter_per_sequence_slopes_gradient_on_cuda_tensors(cupy_gpu):
    """(batch, H) slopes that require grad on CUDA tensors (float32: the CUDA-core kernels give
    the per-row slopes' gradient, summed per sequence on the device) against the float64
    oracle of each sequence on its own."""
    import tiga_numba.torch as tgt
    gen = torch.Generator().manual_seed(12)
    cu, H, Hkv, D, cap = [0, 70, 70, 157], 4, 2, 64, 5.0
    g = tg.Graph.cu_seqlens(np.array(cu), causal=True)
    q64 = torch.randn(157, H, D, dtype=torch.float64, generator=gen).float().double().requires_grad_()
    k64, v64 = (torch.randn(157, Hkv, D, dtype=torch.float64, generator=gen).float().double().requires_grad_()
                for _ in range(2))
    s64 = (torch.rand(3, H, dtype=torch.float64, generator=gen) * 0.2).float().double().requires_grad_()
    dout64 = torch.randn(157, H, D, dtype=torch.float64, generator=gen)
    ref = torch.cat([_flash_oracle(q64[a:b], k64[a:b], v64[a:b], s64[i], cap)
                     for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])) if b > a])
    want = torch.autograd.grad(ref, (q64, k64, v64, s64), dout64)
    q, k, v, slopes = (t.detach().to("cuda", torch.float32).requires_grad_() for t in (q64, k64, v64, s64))
    out = tgt.attention(q, k, v, g, softcap=cap, alibi_slopes=slopes)
    out.backward(dout64.to("cuda", torch.float32))
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=0, atol=2e-5)
    for a, b in zip((q.grad, k.grad, v.grad, slopes.grad), want):
        assert a is not None and a.is_cuda and a.shape == b.shape
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=2e-5 * max(1.0, float(b.abs().max())))


def test_adapter_program_gradients_match_autograd():
    import tiga_numba.torch as tgt

    class Scored(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, scale):
            return self.reducer((src.key * dst.query).sum(axis=-1) * scale, src.value)

    gen = torch.Generator().manual_seed(4)
    n = 9
    q, k, v = (torch.randn(n, 2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
               for _ in range(3))
    g = tg.Graph.triangular(n)
    out = tgt.program(Scored(), g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5)
    cot = torch.randn_like(out)
    out.backward(cot)
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    s = torch.einsum("ihd,jhd->hij", q, k) * 0.5
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("hij,jhd->ihd", s.softmax(-1), v)
    ref.backward(cot)
    torch.testing.assert_close(out, ref)
    for a, t in zip(ours, (q, k, v)):
        torch.testing.assert_close(a, t.grad)


def test_adapter_program_trains_per_head_params():
    """A per-head param given as a tensor (ALiBi slopes) gets its gradient through the wrapper,
    equal to torch autograd of the same score; so does a 0-d float tensor param that requires grad."""
    import tiga_numba.torch as tgt

    class Alibi(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, scale, slopes):
            s = (src.key * dst.query).sum(axis=-1) * scale
            return self.reducer(s - slopes * np.abs(dst.index - src.index), src.value)

    gen = torch.Generator().manual_seed(5)
    n = 9
    q, k, v = (torch.randn(n, 2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
               for _ in range(3))
    slopes = torch.rand(2, dtype=torch.float64, generator=gen).requires_grad_(True)
    g = tg.Graph.triangular(n)
    out = tgt.program(Alibi(), g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5, slopes=slopes)
    cot = torch.randn_like(out)
    out.backward(cot)
    ours = [t.grad.clone() for t in (q, k, v, slopes)]
    for t in (q, k, v, slopes):
        t.grad = None
    i = torch.arange(n, dtype=torch.float64)
    dist = (i[:, None] - i[None, :]).abs()
    s = torch.einsum("ihd,jhd->hij", q, k) * 0.5 - slopes[:, None, None] * dist
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("hij,jhd->ihd", s.softmax(-1), v)
    ref.backward(cot)
    torch.testing.assert_close(out, ref)
    for a, t in zip(ours, (q, k, v, slopes)):
        torch.testing.assert_close(a, t.grad)
    # 0-d float tensors that require grad (one slope for every head; the scale) are learned too
    got, want = [], []
    for run in ("ours", "torch"):
        slope0, scale0 = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (0.3, 0.45))
        if run == "ours":
            o = tgt.program(Alibi(), g, src={"key": k, "value": v}, dst={"query": q}, scale=scale0,
                            slopes=slope0)
        else:
            s = torch.einsum("ihd,jhd->hij", q, k) * scale0 - slope0 * dist
            o = torch.einsum("hij,jhd->ihd", s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(),
                                                           float("-inf")).softmax(-1), v)
        (o * cot).sum().backward()
        (got if run == "ours" else want).extend((o.detach(), slope0.grad, scale0.grad))
    for a, b in zip(got, want):
        assert a is not None and a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_adapter_layer_builds_the_graph_of_each_edge_index_it_is_given():
    """The Graph kept from the last call serves only the same edge_index tensor, unchanged:
    another view of the same storage (same address, shape and version) or a new tensor where a
    freed one lived gets its own relation, and an in-place edit is seen."""
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    import tiga_numba.torch as tgt
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    ours, pyg = tgt.GATConv(4, 3, heads=2), pyg_nn.GATConv(4, 3, heads=2)
    pyg.load_state_dict(ours.state_dict())
    flat = torch.tensor([0, 1, 2, 3, 4, 5, 2, 2, 2, 2, 2, 2])
    a, b = flat.view(2, 6), flat.view(6, 2).t()   # one address, shape and version; other edges
    assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    for ei in (a, b, a):
        torch.testing.assert_close(ours(x, ei), pyg(x, ei), rtol=1e-5, atol=1e-6)
    c = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    ours(x, c)
    c[1, 0] = 5                                   # in place: the version moves on
    torch.testing.assert_close(ours(x, c), pyg(x, c), rtol=1e-5, atol=1e-6)
    for _ in range(8):   # fresh tensors of one shape per step, as in a mini-batch loop
        e = torch.randint(0, 6, (2, 8))
        torch.testing.assert_close(ours(x, e), pyg(x, e), rtol=1e-5, atol=1e-6)
        del e


def test_adapter_layers_train_like_pyg():
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    import tiga_numba.torch as tgt
    torch.manual_seed(0)
    n, f = 40, 6
    ei = torch.randint(0, n, (2, 200))
    ei[:, :3] = ei[0, :3]  # self loops
    x = torch.randn(n, f)
    ea = torch.randn(200, 2)
    for name, kw in (("GATConv", dict(heads=4, edge_dim=2)),
                     ("GATv2Conv", dict(heads=2, share_weights=True)),
                     ("TransformerConv", dict(heads=2, edge_dim=2, beta=True))):
        pyg = getattr(pyg_nn, name)(f, 3, **kw)
        ours = getattr(tgt, name)(f, 3, **kw)
        assert sorted(ours.state_dict()) == sorted(pyg.state_dict())
        ours.load_state_dict(pyg.state_dict())
        use_ea = ea if "edge_dim" in kw else None
        for model in (pyg, ours):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                model(x, ei, use_ea).square().mean().backward()
                opt.step()
        for key, value in pyg.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-4, atol=1e-5,
                                       msg=f"{name} {key}")


def test_a_torch_scalar_does_not_choose_the_results_library():
    """softcap= / scale= given as 0-d tensors are their numbers: numpy q gives numpy results
    (a scalar argument does not decide the library, the arrays do), torch q torch results."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(10, 2, 8)).astype(np.float32)
    g = tg.Graph.triangular(10)
    want = tg.attention(q, q, q, g, softcap=2.0, scale=0.5)
    got = tg.attention(q, q, q, g, softcap=torch.tensor(2.0), scale=torch.tensor(0.5))
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, want)
    t = torch.from_numpy(q)
    got_t = tg.attention(t, t, t, g, softcap=torch.tensor(2.0))
    assert isinstance(got_t, torch.Tensor)
    np.testing.assert_array_equal(got_t.numpy(), tg.attention(q, q, q, g, softcap=2.0))
    with pytest.raises(TypeError, match="softcap"):
        tg.attention(q, q, q, g, softcap=torch.tensor(True))
    tgd = pytest.importorskip("tiga_numba.dask")
    da = pytest.importorskip("dask.array")
    lq = da.from_array(q, chunks=(4, -1, -1))
    got_d = tgd.attention(lq, lq, lq, g, softcap=torch.tensor(2.0), scale=0.5).compute(scheduler="sync")
    np.testing.assert_allclose(got_d, want, rtol=1e-6, atol=1e-6)


def test_a_torch_layer_pickles_after_a_call():
    """The layer's graph memo (a weak reference) is a cache: torch.save / pickle leave it out."""
    import io
    import pickle
    import tiga_numba.torch as tgt
    m = tgt.GATConv(4, 3, heads=2)
    x, ei = torch.randn(6, 4), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    y = m(x, ei)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m2 = torch.load(buf, weights_only=False)
    torch.testing.assert_close(m2(x, ei), y)
    torch.testing.assert_close(pickle.loads(pickle.dumps(m))(x, ei), y)


def test_results_follow_q_library_when_other_arguments_are_torch():
    """The contract's "output in q's library": a numpy q with torch k / v gives numpy results; a
    torch q gives torch; attention_merge follows its first part; the backward's gradients follow
    q, not dout."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q = rng.standard_normal((5, 2, 4)).astype(np.float32)
    k = rng.standard_normal((6, 1, 4)).astype(np.float32)
    v = rng.standard_normal((6, 1, 3)).astype(np.float32)
    g = tg.Graph.dense(6, 5)
    T = torch.from_numpy
    want, st = tg.attention(q, k, v, g, return_stats=True)
    got = tg.attention(q, T(k), T(v), g)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, want)
    assert isinstance(tg.attention(T(q), k, v, g), torch.Tensor)
    a = tg.attention(q, k, v, tg.Graph.dense(6, 5), return_stats=True)
    b = (T(want), tg.attention(T(q), T(k), T(v), g, return_stats=True)[1])
    assert isinstance(tg.attention_merge([a, b])[0], np.ndarray)
    assert isinstance(tg.attention_merge([b, a])[0], torch.Tensor)
    dout = np.ones_like(want)
    assert all(isinstance(x, np.ndarray) for x in tg.attention_backward(T(dout), q, k, v, want, st, g))
    assert all(isinstance(x, torch.Tensor)
               for x in tg.attention_backward(dout, T(q), T(k), T(v), want, st, g))


def test_a_refused_nested_list_does_not_hide_later_tensors():
    """A list nested too deep to be searched (a user error, refused) must not mark lists as
    holding no foreign arrays for every later call."""
    torch = pytest.importorskip("torch")
    import tiga_numba.interop as interop
    q = torch.randn(6, 2, 4, dtype=torch.float64)
    k = torch.randn(5, 1, 4, dtype=torch.float64)
    a = tg.attention(q, k, k, tg.Graph.dense(5, 6), return_stats=True)
    with pytest.raises(TypeError):
        tg.attention_merge([(a[0].tolist(), a[1])])
    assert list not in interop._NATIVE_TYPES and tuple not in interop._NATIVE_TYPES
    out, _ = tg.attention_merge([a])
    assert isinstance(out, torch.Tensor)


def test_stats_built_by_hand_may_hold_torch_tensors():
    """Any object with m and l is stats (docs/robustness.md): torch tensors inside one are
    viewed like every other torch argument, in the backward and in the merge."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((5, 2, 4)) for _ in range(3))
    g = tg.Graph.dense(5)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    # stats of numpy arrays by hand first: the type is not then taken for native for good
    tg.attention_backward(np.ones_like(out), q, k, v, out, SimpleNamespace(m=st.m, l=st.l), g)
    ns = SimpleNamespace(m=torch.from_numpy(st.m), l=torch.from_numpy(st.l))
    want = tg.attention_backward(np.ones_like(out), q, k, v, out, st, g)
    got = tg.attention_backward(np.ones_like(out), q, k, v, out, ns, g)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    merged, _ = tg.attention_merge([(torch.from_numpy(out), ns)])
    np.testing.assert_allclose(merged.numpy(), out, rtol=1e-12)


def test_adapter_refuses_double_backward_and_in_place_changes():
    """tiga_numba.torch: a gradient penalty (create_graph=True) raises instead of dropping the
    penalty's gradient (torch's once_differentiable returns a graph-less gradient for a linear
    loss); an output or input modified in place before the backward (a residual `out += x`)
    makes the backward refuse, as torch's own functions do, instead of reading the new values."""
    torch = pytest.importorskip("torch")
    import tiga_numba.torch as tgt
    torch.manual_seed(0)
    q, k, v, w = (torch.randn(6, 2, 3, dtype=torch.float64) for _ in range(4))
    g = tg.Graph.dense(6)
    qq = q.clone().requires_grad_(True)
    loss = (tgt.attention(qq, k, v, g) * w).sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, qq, create_graph=True)
    qq = q.clone().requires_grad_(True)
    out = tgt.attention(qq, k, v, g)
    out += w
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out ** 2).sum().backward()
    kk = k.clone().requires_grad_(True)
    out = tgt.attention(q, kk, v, g)
    with torch.no_grad():
        kk.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_adapter_and_positions_take_arrays_as_documented():
    """tiga_numba.torch names a non-tensor argument (TypeError, not AttributeError); a torch
    positions tensor (requiring grad) builds a radius graph like any input; a graph keeps its
    own copy of the positions (immutable); a numpy program's vjp takes a torch dout."""
    torch = pytest.importorskip("torch")
    import tiga_numba.torch as tgt
    t = torch.ones(3, 1, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match="q must be a torch tensor"):
        tgt.attention(np.ones((3, 1, 2)), t, t, tg.Graph.dense(3))
    pos = np.random.default_rng(1).random((30, 3))
    g = tg.Graph.radius(torch.tensor(pos, requires_grad=True), 0.4)
    assert g.num_edges == tg.Graph.radius(pos, 0.4).num_edges > 0
    g = tg.Graph.radius(pos, 0.4)
    before = g.edge_field("distance").copy()
    pos *= 3.0
    np.testing.assert_array_equal(g.edge_field("distance"), before)

    class Dot(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge):
            return self.reducer((src.k * dst.q).sum(-1), src.k)
    x = np.random.default_rng(2).standard_normal((4, 1, 3))
    out, vjp = Dot().vjp(graph=tg.Graph.dense(4), src={"k": x}, dst={"q": x})
    want = vjp(np.ones_like(out))
    got = vjp(torch.ones(out.shape, dtype=torch.float64))
    np.testing.assert_array_equal(got["src"]["k"], want["src"]["k"])
