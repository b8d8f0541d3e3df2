"""Every error class of the contract, with its message, on the functional API.
These checks run before any kernel, so they need no compile."""
import numpy as np
import pytest

import tiga_numba as tg


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 4, 8)).astype(np.float32)
    k = rng.standard_normal((6, 2, 8)).astype(np.float32)
    v = rng.standard_normal((6, 2, 3)).astype(np.float32)
    return q, k, v


def test_type_errors(qkv):
    q, k, v = qkv
    g = tg.Graph.dense(6)
    with pytest.raises(TypeError, match="q must be a numpy or cupy array, got list"):
        tg.attention(q.tolist(), k, v, g)
    with pytest.raises(TypeError, match="k has dtype float64 but q has dtype float32"):
        tg.attention(q, k.astype(np.float64), v, g)
    with pytest.raises(TypeError, match="q has unsupported dtype int32"):
        tg.attention(q.astype(np.int32), k, v, g)
    with pytest.raises(TypeError, match="graph must be a tiga_numba.Graph"):
        tg.attention(q, k, v, "dense")
    with pytest.raises(TypeError, match="scale"):
        tg.attention(q, k, v, g, scale="big")


def test_value_errors(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"q has 6 rows \(axis 0\) but graph.num_dst is 7"):
        tg.attention(q, k, v, tg.Graph.dense(6, 7))
    with pytest.raises(ValueError, match=r"k has 6 rows \(axis 0\) but graph.num_src is 5"):
        tg.attention(q, k, v, tg.Graph.dense(5, 6))
    with pytest.raises(ValueError, match=r"multiple of k's heads"):
        tg.attention(q[:, :3], k, v, tg.Graph.dense(6))
    with pytest.raises(ValueError, match=r"k has 0 heads \(axis 1\); k and v need at least one \(q has 0\)"):
        tg.attention(q[:, :0], k[:, :0], v[:, :0], tg.Graph.dense(6))
    with pytest.raises(ValueError, match="head dim"):
        tg.attention(q[:, :, :4], k, v, tg.Graph.dense(6))
    with pytest.raises(ValueError, match="k has 2 heads but v has 1"):
        tg.attention(q, k, v[:, :1], tg.Graph.dense(6))
    with pytest.raises(ValueError, match="3-D"):
        tg.attention(q, k[:, 0], v, tg.Graph.dense(6))
    with pytest.raises(ValueError, match="finite"):
        tg.attention(q, k, v, tg.Graph.dense(6), scale=float("nan"))


@pytest.mark.parametrize("rho", [0.0, -1e-3, 1.5, float("nan")])
def test_threshold_out_of_range(qkv, rho):
    q, k, v = qkv
    with pytest.raises(ValueError, match="block_prune_threshold must be in"):
        tg.attention(q, k, v, tg.Graph.dense(6), block_prune_threshold=rho)


def test_pruning_fails_closed(qkv):
    q, k, v = qkv
    csr = tg.Graph.from_coo([0, 1, 2], [1, 2, 3], num_src=6, num_dst=6)
    with pytest.raises(NotImplementedError, match="tile pruning"):
        tg.attention(q, k, v, csr, block_prune_threshold=0.1)


def test_backward_of_pruned_forward_refused(qkv):
    q, k, v = qkv
    g = tg.Graph.dense(6)
    stats = tg.AttentionStats(np.zeros((6, 4), np.float32), np.ones((6, 4), np.float32),
                              block_prune_threshold=0.01)
    out = np.zeros((6, 4, 3), np.float32)
    with pytest.raises(NotImplementedError, match="pruned"):
        tg.attention_backward(out, q, k, v, out, stats, g)


def test_backward_shape_checks(qkv):
    q, k, v = qkv
    g = tg.Graph.dense(6)
    stats = tg.AttentionStats(np.zeros((6, 4), np.float32), np.ones((6, 4), np.float32))
    out = np.zeros((6, 4, 3), np.float32)
    with pytest.raises(ValueError, match=r"dout must have shape \(6, 4, 3\)"):
        tg.attention_backward(out[:5], q, k, v, out, stats, g)
    bad = tg.AttentionStats(np.zeros((6, 3), np.float32), np.ones((6, 4), np.float32))
    with pytest.raises(ValueError, match=r"stats.m must have shape"):
        tg.attention_backward(out, q, k, v, out, bad, g)


def test_no_edges_returns_contract_values(qkv):
    q, k, v = qkv
    g = tg.Graph.from_csr(np.zeros(7, np.int64), np.zeros(0, np.int64), num_src=6)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    assert out.shape == (6, 4, 3) and out.dtype == np.float32 and not out.any()
    assert np.all(np.isneginf(stats.m)) and not stats.l.any()
    assert stats.m.dtype == np.float32


def test_backward_refuses_stats_of_another_softcap_or_slopes():
    """The stats rebuild the forward's probabilities: a backward with another soft-cap or other
    ALiBi slopes than its forward's would return wrong gradients, so it is a ValueError (raised
    before any backward kernel); the same values (a new but equal slopes array, a numpy scalar)
    pass the check. float64, two heads, D = 4 on a triangle: the forward kernels of
    test_score_mods.test_softcap_alone_and_alibi_alone (no compile of its own)."""
    from tiga_numba.functional import _value_difference
    rng = np.random.default_rng(1)
    g = tg.Graph.triangular(6)
    q, k, v = (rng.standard_normal((6, 2, 4)) for _ in range(3))
    out, st = tg.attention(q, k, v, g, scale=0.5, return_stats=True, softcap=0.7)
    dout = np.ones_like(out)
    with pytest.raises(ValueError, match="softcap = 0.7 in the forward, 3.0 here"):
        tg.attention_backward(dout, q, k, v, out, st, g, scale=0.5, softcap=3.0)
    with pytest.raises(ValueError, match="softcap"):
        tg.attention_backward(dout, q, k, v, out, st, g, scale=0.5)
    slopes = np.array([0.3, 0.9])
    out, st = tg.attention(q, k, v, g, scale=0.5, return_stats=True, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="other values"):
        tg.attention_backward(dout, q, k, v, out, st, g, scale=0.5, alibi_slopes=slopes * 2)
    assert _value_difference(st.score_values, {n: (x.copy() if hasattr(x, "copy") else x)
                                                for n, x in st.score_values.items()}) is None
    assert _value_difference({"softcap": 0.7}, {"softcap": float(np.float64(0.7))}) is None
    nan = np.array([np.nan, 1.0])
    assert _value_difference({"f": nan}, {"f": nan.copy()}) is None   # NaN matches NaN


def test_backward_refuses_stats_that_are_not_floating_point(qkv):
    q, k, v = qkv
    g = tg.Graph.dense(6)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    for bad in (np.bool_, np.int64, np.complex64, object):
        stats = tg.AttentionStats(st.m.astype(bad), st.l.astype(bad))
        with pytest.raises(TypeError, match="stats.m must be floating point"):
            tg.attention_backward(np.ones_like(out), q, k, v, out, stats, g)


def test_argument_checks_without_kernels(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="num_src must be < 2\\*\\*31"):   # before any 16 GiB array
        tg.Graph.from_coo(np.array([2**31]), np.array([0]))
    with pytest.raises(ValueError, match="num_dst must be < 2\\*\\*31"):
        tg.Graph.from_coo(np.array([0]), np.array([0]), num_src=1, num_dst=2**31)
    for bad in ("no", 2, None):
        with pytest.raises(TypeError, match="causal must be True or False"):
            tg.Graph.cu_seqlens(np.array([0, 3]), causal=bad)
    assert tg.Graph.cu_seqlens(np.array([0, 3]), causal=np.True_).num_edges == 6
    with pytest.raises(TypeError, match="left must be an int"):
        tg.Graph.band(5, left=True)
    with pytest.raises(TypeError, match="num_src must be an int"):
        tg.Graph.dense(True)
    with pytest.raises(TypeError, match="non-native byte order"):
        tg.attention(q.astype(">f4"), k, v, tg.Graph.dense(6))
    with pytest.raises(NotImplementedError, match="forward-only"):
        tg.make_plan(q, k, v, tg.Graph.dense(6), op="backward", block_prune_threshold=0.5)
    assert tg.make_plan(q, k, v, tg.Graph.dense(6), block_prune_threshold=np.array(0.5)).prune_threshold == 0.5
    assert tg.online_softmax(np.array(0.25)).block_prune_threshold == 0.25


def test_index_arrays_of_a_float_dtype_are_both_type_and_value_errors():
    """A float cu_seqlens / indptr / indices / src / dst / edge_index is an unsupported dtype
    (TypeError) and a bad CSR or cu_seqlens (ValueError): the error is both, naming the
    argument."""
    G = tg.Graph
    f = np.array([0.0, 2.0, 3.0])
    calls = {"cu_seqlens": lambda: G.cu_seqlens(f),
             "cu_seqlens_k": lambda: G.cu_seqlens([0, 1, 2], cu_seqlens_k=f),
             "indptr": lambda: G.from_csr(f, [0, 1, 0]),
             "indices": lambda: G.from_csr([0, 2, 3], f),
             "src": lambda: G.from_coo(f, [0, 1, 1]),
             "dst": lambda: G.from_coo([0, 1, 1], f),
             r"edge_index\[0\] \(sources\)": lambda: G.from_edge_index(np.array([[0.0, 1.0], [1.0, 0.0]]))}
    for name, call in calls.items():
        for kind in (TypeError, ValueError):
            with pytest.raises(kind, match=f"^{name} must have an integer dtype, got float64"):
                call()
