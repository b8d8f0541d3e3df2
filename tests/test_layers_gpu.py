"""GPU tests of tiga_numba.layers and the torch adapter (marked gpu; skipped without cupy and
a CUDA device): cupy inputs give the numpy path's outputs and gradients; CUDA torch tensors go
through DLPack without a copy and the adapter's layers match PyG's on the GPU."""
import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba.layers import GATConv, GATv2Conv, TransformerConv

cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu

CASES = [
    (GATConv, dict(heads=4, edge_dim=3)),
    (GATConv, dict(heads=2, concat=False, residual=True)),
    (GATv2Conv, dict(heads=2, edge_dim=3)),
    (GATConv, dict(heads=2, edge_dim=3, fill_value="max")),     # the segmented scans on cupy
    (GATv2Conv, dict(heads=2, edge_dim=3, fill_value="mul")),
    (TransformerConv, dict(heads=2, edge_dim=3, beta=True)),
    (TransformerConv, dict(heads=4)),
]


def _graph(rng, n, e):
    src = rng.integers(0, n, e)
    dst = rng.integers(0, n - 2, e)
    dst[: e // 4] = 0  # a hub
    src[:3] = dst[:3]  # self loops
    return src, dst


@pytest.mark.parametrize("cls,kwargs", CASES)
def test_cupy_matches_numpy(cls, kwargs):
    rng = np.random.default_rng(0)
    n, e, f = 300, 3000, 8
    src, dst = _graph(rng, n, e)
    g = tg.Graph.from_coo(src, dst, n, n)
    layer = cls(f, 6, seed=1, **kwargs)
    x = rng.standard_normal((n, f)).astype(np.float32)
    ea = rng.standard_normal((e, 3)).astype(np.float32) if "edge_dim" in kwargs else None
    out, vjp = layer.vjp(x, g, ea)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    ref = vjp(dout)
    layer.to("cuda")
    out_d, vjp_d = layer.vjp(cupy.asarray(x), g, None if ea is None else cupy.asarray(ea))
    assert isinstance(out_d, cupy.ndarray)
    got = vjp_d(cupy.asarray(dout))
    tol = dict(rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(cupy.asnumpy(out_d), out, **tol)
    np.testing.assert_allclose(cupy.asnumpy(got["x"]), ref["x"], **tol)
    if ea is not None:
        np.testing.assert_allclose(cupy.asnumpy(got["edge_attr"]), ref["edge_attr"], **tol)
    for k, v in ref["params"].items():
        np.testing.assert_allclose(cupy.asnumpy(got["params"][k]), v, err_msg=k, **tol)


@pytest.mark.parametrize("cls,kwargs", CASES)
def test_cupy_attention_weights_match_numpy(cls, kwargs):
    """return_attention_weights=True on cupy: the numpy call's edge_index (the same ints) and
    weights, as cupy arrays."""
    rng = np.random.default_rng(5)
    n, e, f = 300, 3000, 8
    src, dst = _graph(rng, n, e)
    g = tg.Graph.from_coo(src, dst, n, n)
    layer = cls(f, 6, seed=2, **kwargs).eval()
    x = rng.standard_normal((n, f)).astype(np.float32)
    ea = rng.standard_normal((e, 3)).astype(np.float32) if "edge_dim" in kwargs else None
    out, (ei, alpha) = layer(x, g, ea, return_attention_weights=True)
    layer.to("cuda")
    out_d, (ei_d, alpha_d) = layer(cupy.asarray(x), g, None if ea is None else cupy.asarray(ea),
                                   return_attention_weights=True)
    assert isinstance(ei_d, cupy.ndarray) and isinstance(alpha_d, cupy.ndarray)
    assert np.array_equal(cupy.asnumpy(ei_d), ei) and alpha_d.dtype == alpha.dtype
    np.testing.assert_allclose(cupy.asnumpy(alpha_d), alpha, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(cupy.asnumpy(out_d), out, rtol=2e-4, atol=2e-5)


def test_cuda_tensors_without_copy_and_adapter_matches_pyg():
    torch = pytest.importorskip("torch")
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    import tiga_numba.torch as tgt
    from tiga_numba import interop
    t = torch.randn(10, 4, device="cuda")
    view = interop.to_native(t)
    assert isinstance(view, cupy.ndarray) and view.data.ptr == t.data_ptr()
    torch.manual_seed(0)
    n, e, f = 500, 6000, 16
    ei = torch.randint(0, n, (2, e), device="cuda")
    x = torch.randn(n, f, device="cuda")
    ea = torch.randn(e, 3, device="cuda")
    for name, kw in (("GATConv", dict(heads=8, edge_dim=3)), ("GATv2Conv", dict(heads=2)),
                     ("TransformerConv", dict(heads=4, edge_dim=3))):
        pyg = getattr(pyg_nn, name)(f, 8, **kw).cuda()
        ours = getattr(tgt, name)(f, 8, **kw).cuda()
        ours.load_state_dict(pyg.state_dict())
        use = ea if "edge_dim" in kw else None
        outs = []
        for model in (pyg, ours):
            xr = x.clone().requires_grad_(True)
            out = model(xr, ei, use)
            out.square().sum().backward()
            outs.append((out.detach(), xr.grad, {k: p.grad for k, p in model.named_parameters()}))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-3, atol=1e-3)
        assert sorted(outs[1][2]) == sorted(outs[0][2])
        for k, b in outs[0][2].items():
            torch.testing.assert_close(outs[1][2][k], b, rtol=1e-3, atol=1e-3, msg=f"{name} {k}")
