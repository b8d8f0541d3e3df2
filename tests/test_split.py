"""Work divided by edges: hub rows (one destination with most edges, one source read by every
destination) are split into pieces and merged in fixed order; results match the float64
oracle and carry the same bits with any thread count."""
import numpy as np
import pytest

import tiga_numba as tg
from conftest import attention_oracle, numba_threads
from tiga_numba.cpu import split


def hub_graph(rng, n=300, hub_deg=9000, hub_src=0):
    """Destination 7 receives hub_deg edges (with repeats: a multigraph); every destination
    also reads source hub_src; a few rows are empty."""
    src = [rng.integers(0, n, hub_deg)]
    dst = [np.full(hub_deg, 7)]
    src.append(np.full(n + 5000, hub_src))
    dst.append(np.concatenate([np.arange(n), rng.integers(0, n, 5000)]))
    small = rng.integers(0, n, (2, 3 * n))
    src.append(small[0])
    dst.append(small[1])
    src, dst = np.concatenate(src), np.concatenate(dst)
    keep = (dst != 11) & (dst != 200)
    return tg.Graph.from_coo(src[keep], dst[keep], n, n)


def oracle(q, k, v, g, dout):
    """Per-edge float64 attention and gradients (multigraph-safe)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    ip, ix = g._host_csr()
    rows = np.repeat(np.arange(g.num_dst), np.diff(ip))
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    grp = H // Hkv
    kk = np.repeat(k, grp, axis=1)[ix]
    vv = np.repeat(v, grp, axis=1)[ix]
    s = np.einsum("ehd,ehd->eh", q[rows], kk) * D ** -0.5
    m = np.full((g.num_dst, H), -np.inf)
    np.maximum.at(m, rows, s)
    p = np.exp(s - m[rows])
    l = np.zeros((g.num_dst, H))
    np.add.at(l, rows, p)
    p = p / l[rows]
    out = np.zeros((g.num_dst, H, v.shape[2]))
    np.add.at(out, rows, p[..., None] * vv)
    dp = np.einsum("ehd,ehd->eh", dout[rows], vv)
    delta = np.einsum("nhd,nhd->nh", dout, out)
    ds = p * (dp - delta[rows]) * D ** -0.5
    dq = np.zeros_like(q)
    np.add.at(dq, rows, ds[..., None] * kk)
    dk = np.zeros((k.shape[0], H, D))
    np.add.at(dk, ix, ds[..., None] * q[rows])
    dv = np.zeros((v.shape[0], H, v.shape[2]))
    np.add.at(dv, ix, p[..., None] * dout[rows])
    dk = dk.reshape(k.shape[0], Hkv, grp, D).sum(2)
    dv = dv.reshape(v.shape[0], Hkv, grp, v.shape[2]).sum(2)
    return out, dq, dk, dv


def test_pieces_cover_every_edge_once():
    rng = np.random.default_rng(0)
    deg = np.concatenate([rng.integers(0, 5, 1000), [50000], rng.integers(0, 3, 500), [3000]])
    indptr = np.concatenate([[0], np.cumsum(deg)])
    items, splits, n_slots = split.row_pieces(indptr, 32)
    covered = np.zeros(indptr[-1], np.int64)
    for r0, r1, e0, e1, slot in items:
        for i in range(r0, r1):
            a, b = max(indptr[i], e0), min(indptr[i + 1], e1)
            covered[a:b] += 1
        assert slot < 0 or r1 == r0 + 1
    assert np.all(covered == 1)
    assert splits.shape[0] >= 1 and n_slots == splits[:, 2].sum()
    long_rows = set(np.flatnonzero(deg > split.piece_length(indptr[-1] + deg.size)))
    assert set(splits[:, 0]) == long_rows


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_items_are_ordered_for_the_static_schedule(threads):
    """numba's static prange gives each of T threads one contiguous run of equal item counts:
    order_balanced makes those runs carry about equal work, also when a few items hold most of
    it (the pieces of a power-law graph's long rows), and the pieces still cover every edge."""
    from tiga_numba.cpu.layout import order_balanced
    rng = np.random.default_rng(threads)
    costs = np.concatenate([rng.integers(1, 60, 3000), np.full(130, 2000), rng.integers(500, 2048, 200)])
    rng.shuffle(costs)
    order = order_balanced(costs, threads)
    assert sorted(order.tolist()) == list(range(costs.size))
    runs = np.array_split(costs[order], threads)   # numba's static chunks: equal counts
    loads = np.array([r.sum() for r in runs])
    assert loads.max() <= 1.02 * loads.mean() + costs.max()
    if threads == 1:
        assert np.array_equal(order, np.arange(costs.size))
    deg = np.concatenate([rng.integers(0, 5, 1000), [50000], rng.integers(0, 3, 500), [3000]])
    indptr = np.concatenate([[0], np.cumsum(deg)])
    items, _, _ = split.row_pieces(indptr, 32, threads)
    ref, _, _ = split.row_pieces(indptr, 32, 1)
    key = lambda a: sorted(map(tuple, a.tolist()))  # noqa: E731
    assert key(items) == key(ref)   # the same items, only their order depends on the threads


@pytest.mark.parametrize("dtype,tol", [(np.float32, 3e-5), (np.float64, 1e-11)])
def test_hub_rows_match_oracle_and_bits_do_not_depend_on_threads(dtype, tol):
    rng = np.random.default_rng(1)
    g = hub_graph(rng)
    n = g.num_dst
    q = rng.standard_normal((n, 4, 16)).astype(dtype)
    k = rng.standard_normal((n, 2, 16)).astype(dtype)
    v = rng.standard_normal((n, 2, 8)).astype(dtype)
    dout = rng.standard_normal((n, 4, 8)).astype(dtype)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    assert "split into" in st.plan.run_info["tiles"]
    dq, dk, dv = tg.attention_backward(dout, q, k, v, out, st, g)
    assert st.plan.run_info["tiles"].count("split into") == 1
    assert tg.explain().count("split into") == 2  # the backward split dq and dk/dv rows
    ref = oracle(q, k, v, g, dout)
    for got, want in zip((out, dq, dk, dv), ref):
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol * 10)
    assert np.all(out[[11, 200]] == 0) and np.all(st.m[[11, 200]] == -np.inf)
    with numba_threads(1):
        out1, st1 = tg.attention(q, k, v, g, return_stats=True)
        grads1 = tg.attention_backward(dout, q, k, v, out1, st1, g)
    assert np.array_equal(out1, out)
    for a, b in zip(grads1, (dq, dk, dv)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("make", [
    lambda: tg.Graph.dense(40000, 12),
    lambda: tg.Graph.cu_seqlens([0, 10, 20, 20, 32], cu_seqlens_k=[0, 9000, 30000, 30001, 39000]),
    lambda: tg.Graph.band(40000, 12, left=None, right=39000)])
def test_decode_shapes_split_the_key_range(make):
    """Few query tiles over long key ranges in the block kernels (blocks of more than 8 query
    rows: fewer go to the split-key kernel, tests/test_cpu_decode.py)."""
    g = make()
    rng = np.random.default_rng(4)
    q = rng.standard_normal((g.num_dst, 8, 32)).astype(np.float32)
    k = rng.standard_normal((g.num_src, 2, 32)).astype(np.float32)
    v = rng.standard_normal((g.num_src, 2, 16)).astype(np.float32)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    assert "key ranges" in st.plan.run_info["tiles"]
    # a key tile read by one query tile only is read in place, not packed first
    assert not any("transposed" in c for c in st.plan.run_info["copies"])
    np.testing.assert_allclose(out, attention_oracle(q, k, v, g.to_scipy().toarray())[0], atol=2e-5)
    with numba_threads(1):
        out1 = tg.attention(q, k, v, g)
    assert np.array_equal(out1, out)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = tg.attention_backward(dout, q, k, v, out, st, g)
    assert all(np.isfinite(x).all() for x in grads)
