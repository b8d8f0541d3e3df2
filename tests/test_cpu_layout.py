"""The CPU kernels' operand copies (cpu/layout.py): the threaded copies give numpy's bits, the
finiteness test finds every non-finite value, the per-head transpose is exact."""
import numpy as np
import pytest

from tiga_numba.cpu import layout


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("scale", [None, 0.1767766952966369 * 1.4426950408889634])
def test_head_and_node_major_copies_match_numpy_bits(dtype, scale):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((37, 6, 24)) * 50).astype(dtype)[:, ::2]   # strided heads
    acc = layout.acc_dtype_of(dtype)
    want = x.astype(acc)
    if scale is not None:
        want = want * acc.type(scale)
    copies = []
    hm = layout.head_major(x, acc, "x", copies, scale=scale)
    nm = layout.node_major(x, acc, "x", copies, scale=scale)
    assert hm.shape == (3, 37, 24) and hm.flags.c_contiguous and hm.dtype == acc
    assert np.array_equal(hm, want.transpose(1, 0, 2)) and np.array_equal(nm, want)
    assert len(copies) == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_finds_each_kind_of_non_finite_value(dtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 33, 7)).astype(dtype) * 1e30
    assert layout.all_finite(x)
    assert layout.all_finite(x[:0])
    for bad in (np.nan, np.inf, -np.inf):
        for pos in ((0, 0, 0), (4, 32, 6), (2, 17, 3)):
            y = x.copy()
            y[pos] = bad
            assert not layout.all_finite(y), (bad, pos)
    assert not layout.all_finite(np.array([[np.finfo(dtype).max, np.nan]], dtype)[:, ::-1])   # strided


def test_transposed_heads_is_exact():
    rng = np.random.default_rng(2)
    for shape in ((2, 1, 3), (3, 130, 64), (1, 64, 5), (2, 0, 4)):
        x = rng.standard_normal(shape).astype(np.float32)
        assert np.array_equal(layout.transposed_heads(x), x.transpose(0, 2, 1))
        padded = layout.transposed_heads(x, pad=16)   # the own products' whole column blocks
        assert padded.shape == (shape[0], shape[2], shape[1] + 16)
        assert np.array_equal(padded[:, :, :shape[1]], x.transpose(0, 2, 1))
        assert not padded[:, :, shape[1]:].any()


def test_the_block_kernels_zero_fill_only_rows_no_item_writes():
    """out / m / l and dk / dv start uninitialised only when every row lies in a block with work:
    any block for destinations, a block with destinations for keys."""
    import tiga_numba as tg
    from tiga_numba.cpu import api

    def writes_all(g):
        return api._blocks_cover(g.realize("cpu"), g.num_src, "src")

    def writes_all_rows(g):
        return api._blocks_cover(g.realize("cpu"), g.num_dst, "dst")
    assert writes_all_rows(tg.Graph.cu_seqlens([0, 0, 5], cu_seqlens_k=[0, 3, 8]))
    assert writes_all_rows(tg.Graph.cat([tg.Graph.dense(4, 4), tg.Graph.dense(0, 6)]))   # rows, no keys
    assert writes_all_rows(tg.Graph.band(40, left=3)) and writes_all_rows(tg.Graph.dense(3, 1))
    assert writes_all(tg.Graph.dense(5, 7)) and writes_all(tg.Graph.triangular(9))
    assert writes_all(tg.Graph.band(40, left=3))
    assert writes_all(tg.Graph.cu_seqlens([0, 3, 8]))
    # keys of a block without destinations: no work item writes their rows
    assert not writes_all(tg.Graph.cu_seqlens([0, 0, 5], cu_seqlens_k=[0, 3, 8]))
    assert not writes_all(tg.Graph.cat([tg.Graph.dense(4, 4), tg.Graph.dense(6, 0)]))
    q, k, v, do = (np.random.default_rng(5).standard_normal((n, 2, 8)) for n in (5, 8, 8, 5))
    g = tg.Graph.cu_seqlens([0, 0, 5], cu_seqlens_k=[0, 3, 8])
    out, st = tg.attention(q, k, v, g, return_stats=True)
    dq, dk, dv = tg.attention_backward(do, q, k, v, out, st, g)
    assert np.all(dk[:3] == 0) and np.all(dv[:3] == 0) and np.all(dk[3:] != 0)
    g = tg.Graph.cat([tg.Graph.dense(4, 4), tg.Graph.dense(0, 3)])   # 3 rows without keys
    q, k, v = (np.random.default_rng(6).standard_normal((n, 2, 8)) for n in (7, 4, 4))
    out, st = tg.attention(q, k, v, g, return_stats=True)
    assert np.all(out[4:] == 0) and np.all(np.isneginf(st.m[4:])) and np.all(st.l[4:] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_contiguous_copies_exactly_and_keeps_contiguous_arrays(dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 41, 16)).astype(np.float32)
    y = x.transpose(1, 0, 2)
    got = layout.contiguous(y, dtype)
    assert got.flags.c_contiguous and got.dtype == dtype and np.array_equal(got, y.astype(dtype))
    z = np.ascontiguousarray(y, dtype=dtype)
    assert layout.contiguous(z, dtype) is z


@pytest.mark.parametrize("make", [lambda tg: tg.Graph.band(1000, left=100), lambda tg: tg.Graph.triangular(700),
                                  lambda tg: tg.Graph.dense(300, 500),
                                  lambda tg: tg.Graph.cu_seqlens([0, 5, 5, 300, 310], causal=True)],
                         ids=["band", "causal", "dense", "segments"])
def test_backward_partitions_are_balanced_runs_with_boxes_covering_their_rows(make):
    """The block backward deals contiguous runs of its key-tile items to the dq partitions, of
    about equal cost, each with the box of dq (heads, rows) its items write."""
    import tiga_numba as tg
    from tiga_numba.cpu import api
    rel = make(tg).realize("cpu")
    Hkv, group, BM, BN = 2, 3, 64, 32
    items, costs, first, last = api._backward_items(rel, Hkv, group, BM, BN, rows=True)
    dealt, boxes, n_parts = api._dealt_backward_items(rel, Hkv, group, BM, BN)
    assert n_parts == min(api.N_PARTS, items.shape[0])
    key = {tuple(x): i for i, x in enumerate(items.tolist())}
    seen, part_cost = [], np.zeros(n_parts)
    for w, it in enumerate(dealt.tolist()):
        if it[0] < 0:
            continue
        p, i = w % n_parts, key[tuple(it)]
        seen.append(i)
        part_cost[p] += costs[i]
        h0, h1, r0, r1 = boxes[p]
        assert h0 <= it[0] * group and (it[0] + 1) * group <= h1
        if last[i] > first[i]:
            assert r0 <= first[i] and last[i] <= r1
    assert sorted(seen) == list(range(items.shape[0]))   # every item once
    assert part_cost.max() <= costs.sum() / n_parts + costs.max()
