"""Graph constructors, properties and validation against scipy / brute force."""
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings, strategies as st

import tiga_numba as tg


def mask(graph):
    return graph.to_scipy().toarray()


def test_dense_square_and_rectangular():
    g = tg.Graph.dense(5)
    assert (g.kind, g.num_src, g.num_dst, g.num_edges) == ("dense", 5, 5, 25)
    r = tg.Graph.dense(3, 7)
    assert (r.num_src, r.num_dst, r.num_edges) == (3, 7, 21)
    assert mask(r).shape == (7, 3) and mask(r).all()
    assert isinstance(r.num_edges, int)


def test_triangular_is_lower_triangle():
    g = tg.Graph.triangular(6)
    assert g.kind == "triangular" and g.num_edges == 21
    np.testing.assert_array_equal(mask(g), np.tri(6, dtype=bool))


@pytest.mark.parametrize("causal", [True, False])
def test_cu_seqlens_blocks(causal):
    cu = [0, 3, 3, 4, 9]
    g = tg.Graph.cu_seqlens(np.array(cu), causal=causal)
    expect = np.zeros((9, 9), bool)
    for a, b in zip(cu[:-1], cu[1:]):
        blk = np.tri(b - a, dtype=bool) if causal else np.ones((b - a, b - a), bool)
        expect[a:b, a:b] = blk
    np.testing.assert_array_equal(mask(g), expect)
    assert g.num_edges == int(expect.sum())
    assert g.kind == "segments"


def test_cat_of_implicit_blocks_stays_implicit_and_matches_cu_seqlens():
    lengths = [4, 1, 0, 3]
    cat = tg.Graph.cat([tg.Graph.triangular(n) for n in lengths])
    cu = tg.Graph.cu_seqlens(np.cumsum([0] + lengths))
    assert cat.is_implicit
    np.testing.assert_array_equal(mask(cat), mask(cu))


def test_cat_rectangular_and_csr_blocks():
    csr = tg.Graph.from_coo([0, 1], [1, 0], num_src=2, num_dst=2)
    g = tg.Graph.cat([tg.Graph.dense(2, 3), csr])
    assert g.kind == "csr" and (g.num_dst, g.num_src) == (5, 4)
    expect = np.zeros((5, 4), bool)
    expect[:3, :2] = True
    expect[3, 3] = expect[4, 2] = True
    np.testing.assert_array_equal(mask(g), expect)


def test_from_scipy_round_trip_and_coo_order():
    rng = np.random.default_rng(0)
    a = sp.random(7, 5, density=0.4, random_state=1, format="coo")
    g = tg.Graph.from_scipy(a)
    np.testing.assert_array_equal(mask(g), a.toarray() != 0)
    src = rng.integers(0, 6, 20)
    dst = rng.integers(0, 6, 20)
    c = tg.Graph.from_coo(src, dst)
    indptr, indices = c._host_csr()
    order = np.argsort(dst, kind="stable")
    np.testing.assert_array_equal(indices, src[order])
    assert c.num_edges == 20


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), max_size=6), min_size=1, max_size=8))
def test_transpose_is_consistent(rows):
    indptr = np.cumsum([0] + [len(r) for r in rows])
    indices = np.array([j for r in rows for j in r], dtype=np.int64)
    g = tg.Graph.from_csr(indptr, indices, num_src=7)
    t = g.realize_transpose("cpu")
    rows_of_edge = np.repeat(np.arange(len(rows)), np.diff(indptr))
    # each transposed entry names an edge whose source is that row and whose destination is listed
    for j in range(7):
        for p in range(t.indptr[j], t.indptr[j + 1]):
            e = t.perm[p]
            assert indices[e] == j and rows_of_edge[e] == t.indices[p]
        assert np.all(np.diff(t.perm[t.indptr[j]:t.indptr[j + 1]]) > 0)
    assert sorted(t.perm.tolist()) == list(range(len(indices)))


def test_explain_is_one_line():
    for g in (tg.Graph.dense(4), tg.Graph.cu_seqlens([0, 2, 5]), tg.Graph.from_coo([0], [1])):
        text = g.explain()
        assert "\n" not in text and g.kind in text and str(g.num_edges) in text


def test_device_keyword_is_accepted():
    assert tg.Graph.dense(3, device="cuda").device == "cuda"
    with pytest.raises(ValueError, match="device"):
        tg.Graph.dense(3, device="tpu")


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize("cu, match", [
    ([1, 3], "start at 0"),
    ([0, 4, 2], "non-decreasing"),
    ([[0, 1], [1, 2]], "1-D"),
    ([], "at least one"),
])
def test_bad_cu_seqlens(cu, match):
    with pytest.raises(ValueError, match=match):
        tg.Graph.cu_seqlens(np.array(cu, dtype=np.int64))


@pytest.mark.parametrize("indptr, indices, match", [
    ([1, 2], [0], "indptr must start at 0"),
    ([0, 2, 1], [0, 1], "non-decreasing"),
    ([0, 1], [0, 1], r"indptr\[-1\]"),
    ([0, 2], [0, -1], "out of range"),
])
def test_bad_csr(indptr, indices, match):
    with pytest.raises(ValueError, match=match):
        tg.Graph.from_csr(np.array(indptr), np.array(indices))


def test_full_validation_names_first_bad_index():
    with pytest.raises(ValueError, match=r"indices\[2\]=9 \(row 1\)"):
        tg.Graph.from_csr(np.array([0, 1, 3]), np.array([0, 1, 9]), num_src=4, validate="full")
    with pytest.raises(ValueError, match="out of range"):
        tg.Graph.from_csr(np.array([0, 1, 3]), np.array([0, 1, 9]), num_src=4)
    with pytest.raises(ValueError, match="validate"):
        tg.Graph.from_csr(np.array([0]), np.array([], np.int64), validate="yes")


def test_constructor_type_errors():
    with pytest.raises(TypeError, match="indices"):
        tg.Graph.from_csr(np.array([0, 1]), np.array([0.5]))
    with pytest.raises(TypeError, match="num_src"):
        tg.Graph.dense(2.5)
    with pytest.raises(ValueError, match="num_src"):
        tg.Graph.dense(-1)
    with pytest.raises(TypeError, match="graphs"):
        tg.Graph.cat([tg.Graph.dense(2), "x"])
    with pytest.raises(TypeError, match="matrix"):
        tg.Graph.from_scipy(np.eye(3))


@pytest.mark.parametrize("bad", [None, "0,3", {0: 1}, object()])
def test_index_arrays_of_the_wrong_type_raise_type_error(bad):
    """None, a string, a mapping: the wrong array type (TypeError naming the argument), not a
    shape error; an integer scalar is the wrong shape (ValueError)."""
    G = tg.Graph
    for call, name in ((lambda: G.from_csr(bad, [0]), "indptr"), (lambda: G.from_csr([0, 1], bad), "indices"),
                       (lambda: G.from_coo(bad, [0]), "src"), (lambda: G.from_coo([0], bad), "dst"),
                       (lambda: G.from_edge_index(bad), "edge_index"), (lambda: G.cu_seqlens(bad), "cu_seqlens"),
                       (lambda: G.cu_seqlens([0, 1], cu_seqlens_k=bad), "cu_seqlens_k")):
        if bad is None and name.startswith("cu_seqlens"):
            continue   # None is their default (cu_seqlens_q= may give the offsets; same keys)
        with pytest.raises(TypeError, match=name):
            call()
    with pytest.raises(ValueError, match="indptr must be 1-D"):
        G.from_csr(5, [0])


def test_from_coo_edge_permutation_maps_input_fields():
    src = np.array([2, 0, 1, 0])
    dst = np.array([1, 0, 1, 2])
    g = tg.Graph.from_coo(src, dst, num_src=3, num_dst=3)
    indptr, indices = g._host_csr()
    field = np.array([10.0, 20.0, 30.0, 40.0])  # one value per input edge
    np.testing.assert_array_equal(indices, src[g.edge_permutation])
    np.testing.assert_array_equal(field[g.edge_permutation], [20.0, 10.0, 30.0, 40.0])
    assert tg.Graph.dense(3).edge_permutation is None


def test_from_scipy_edge_permutation_follows_the_stored_entries():
    """from_scipy's input order is the matrix's stored order (tocoo's); an entry given twice is
    one edge at its first place; a canonical CSR matrix needs no permutation."""
    row = np.array([2, 0, 2, 0, 1, 0])
    col = np.array([1, 2, 0, 2, 1, 0])          # (0, 2) given twice
    m = sp.coo_matrix((np.arange(6.0), (row, col)), shape=(3, 3))
    g = tg.Graph.from_scipy(m)
    indptr, indices = g._host_csr()
    assert g.num_edges == 5
    np.testing.assert_array_equal(indptr, [0, 2, 3, 5])
    np.testing.assert_array_equal(indices, [0, 2, 1, 0, 1])
    # distinct edges in first-entry order: (2,1) (0,2) (2,0) (1,1) (0,0)
    first = np.array([[2, 1], [0, 2], [2, 0], [1, 1], [0, 0]])
    rows = np.repeat(np.arange(3), np.diff(indptr))
    np.testing.assert_array_equal(first[g.edge_permutation], np.stack([rows, indices], 1))
    assert tg.Graph.from_scipy(m.tocsr()).edge_permutation is None   # canonical: CSR order
    csc = tg.Graph.from_scipy(sp.csc_matrix(np.array([[0, 1.0], [1.0, 1.0]])))
    np.testing.assert_array_equal(csc.edge_permutation, [1, 0, 2])   # stored: (1,0) (0,1) (1,1)


def test_arrays_a_graph_hands_out_cannot_change_it():
    """Graph is immutable: edge_permutation and a geometric graph's positions come back
    read-only, so writing into them raises and later calls see the graph as built"""
    g = tg.Graph.from_coo([0, 1, 2], [2, 0, 1], num_src=3, num_dst=3)
    perm = g.edge_permutation
    with pytest.raises(ValueError, match="read-only"):
        perm[:] = 0
    np.testing.assert_array_equal(g.edge_permutation, [1, 2, 0])
    pos = np.random.default_rng(0).random((20, 3))
    gr = tg.Graph.radius(pos, 0.4)
    before = gr.edge_field("distance").copy()
    with pytest.raises(ValueError, match="read-only"):
        gr.positions[:] *= 100
    pos[:] *= 100   # nor does the caller's own array reach the graph
    np.testing.assert_array_equal(gr.edge_field("distance"), before)
    assert before.max() <= 0.4


def test_cat_of_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        tg.Graph.cat([])


class _FakeDeviceArray:
    """Stands in for a cupy array: __cuda_array_interface__, shape, .get() (counted)."""

    def __init__(self, a):
        self._a = np.asarray(a)
        self.shape = self._a.shape
        self.dtype = self._a.dtype
        self.gets = 0
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": self.dtype.str,
                                         "data": (0, False), "version": 3}

    def get(self):
        self.gets += 1
        return self._a.copy()


def test_device_csr_is_used_in_place_and_copied_to_the_host_once_on_demand():
    """A GPU-built geometric graph keeps its CSR on the device: realize("cuda") hands the same
    arrays back, and the host copy is made only when a host consumer asks, then kept."""
    rng = np.random.default_rng(3)
    pos = rng.random((40, 3))
    host = tg.Graph.radius(pos, 0.3)
    ip, ix = host._host_csr()
    dip, dix = _FakeDeviceArray(ip), _FakeDeviceArray(ix)
    g = tg.Graph._geometric(pos, dip, dix, None)
    assert g.device == "cuda" and g.num_edges == host.num_edges and g.edge_field_names
    rel = g.realize("cuda")
    assert rel.indptr is dip and rel.indices is dix and rel.num_src == 40
    assert dip.gets == dix.gets == 0 and "cuda" in g.explain() and "cpu" not in g.explain()
    np.testing.assert_array_equal(g.to_scipy().toarray(), host.to_scipy().toarray())
    np.testing.assert_array_equal(g.realize("cpu").indices, ix)
    t, th = g.realize_transpose("cpu"), host.realize_transpose("cpu")
    np.testing.assert_array_equal(t.perm, th.perm)
    assert dip.gets == dix.gets == 1, "the host copy must be made once"


def test_cat_keeps_its_parts_input_edge_order():
    """tg.Graph.cat of COO-built graphs: per-edge arrays are given in the parts' input orders one
    after the other (PyG's Batch of edge_attr), as for from_coo of the shifted, concatenated
    edges; a program field and a layer's edge_attr reach the same edges either way."""
    from tiga_numba.layers import GATConv
    rng = np.random.default_rng(11)
    sizes, parts, src_all, dst_all = (5, 7, 4), [], [], []
    off = 0
    for n in sizes:
        e = 3 * n
        s, d = rng.integers(0, n, e), rng.integers(0, n, e)
        parts.append(tg.Graph.from_coo(s, d, n, n) if n != 4 else tg.Graph.dense(n))
        if n == 4:   # a dense part: its input order is its row-major CSR order
            d, s = np.divmod(np.arange(n * n), n)
        src_all.append(s + off)
        dst_all.append(d + off)
        off += n
    cat = tg.Graph.cat(parts)
    ref = tg.Graph.from_coo(np.concatenate(src_all), np.concatenate(dst_all), off, off)
    np.testing.assert_array_equal(cat.edge_permutation, ref.edge_permutation)
    x = rng.standard_normal((off, 6)).astype(np.float32)
    ea = rng.standard_normal((cat.num_edges, 3)).astype(np.float32)
    layer = GATConv(6, 4, heads=2, edge_dim=3, add_self_loops=False, seed=0)
    np.testing.assert_allclose(layer(x, cat, ea), layer(x, ref, ea), rtol=1e-5, atol=1e-6)
    assert tg.Graph.cat([tg.Graph.dense(3), tg.Graph.triangular(2)]).edge_permutation is None
