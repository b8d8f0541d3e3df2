"""Radius and knn graphs (cell lists) against scipy.spatial.cKDTree and brute force.

Host builder (numpy): directly. GPU builder (tiga_numba.cuda.neighbors): in the CUDA
simulator on small inputs (a subprocess with NUMBA_ENABLE_CUDASIM=1; `NUMBA_ENABLE_CUDASIM=1
python tests/test_neighbors.py sim radius|knn` runs it directly), compiled to PTX for sm_90,
and on a real GPU (marked gpu) through Graph.radius/knn with cupy positions. The GPU builder
must give the host builder's graph exactly (same edges, same order), and both cKDTree's.
"""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy.spatial import cKDTree

import tiga_numba  # noqa: F401  (shields tiga_numba.cuda from numba-cuda's import redirector)
from tiga_numba import neighbors
from tiga_numba.graph import Graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None


def _rows(indptr, indices):
    return [indices[indptr[i]:indptr[i + 1]].tolist() for i in range(len(indptr) - 1)]


def _check_csr(indptr, indices, n):
    assert indptr.dtype == np.int64 and indices.dtype == np.int32
    assert indptr.shape == (n + 1,) and indptr[0] == 0 and indptr[-1] == indices.shape[0]
    assert np.all(np.diff(indptr) >= 0)
    for row in _rows(indptr, indices):
        assert row == sorted(row)


@pytest.mark.parametrize("n,dim,cutoff,exclude", [
    (0, 3, 0.1, True), (1, 3, 0.5, True), (1, 3, 0.5, False), (2, 3, 10.0, True),
    (257, 3, 0.15, True), (300, 3, 0.2, False), (200, 2, 0.12, True), (150, 1, 0.02, True),
    (400, 3, 0.0, True),
])
def test_radius_graph_matches_ckdtree(n, dim, cutoff, exclude):
    rng = np.random.default_rng(n + dim)
    pos = rng.random((n, dim))
    if n > 10:
        pos[:5] = pos[5]  # duplicated points: distance 0, distinct ids
        pos[-3:] += 50.0 * np.arange(1, 4)[:, None]  # isolated points
    indptr, indices = neighbors.radius_graph(pos, cutoff, exclude_self=exclude)
    _check_csr(indptr, indices, n)
    if n == 0:
        return
    tree = cKDTree(pos)
    ref = [sorted(j for j in tree.query_ball_point(pos[i], cutoff) if not (exclude and j == i))
           for i in range(n)]
    assert _rows(indptr, indices) == ref


def test_radius_graph_sparse_cloud_and_float32():
    """Points spread over a huge box (the grid must not allocate a cell per cutoff^3)."""
    rng = np.random.default_rng(3)
    pos = (rng.random((500, 3)) * 1e6).astype(np.float32)
    pos[1] = pos[0] + 0.5
    indptr, indices = neighbors.radius_graph(pos, 1.0)
    assert _rows(indptr, indices)[0] == [1] and _rows(indptr, indices)[1] == [0]
    assert indices.shape[0] == 2
    assert neighbors.last_build_info()["cells"] <= 2 * 500 + 64


@pytest.mark.parametrize("n,dim,k,exclude", [
    (1, 3, 3, True), (5, 3, 10, True), (5, 3, 10, False), (200, 3, 7, True),
    (300, 2, 16, True), (120, 1, 4, False), (64, 3, 0, True),
])
def test_knn_graph_matches_ckdtree(n, dim, k, exclude):
    rng = np.random.default_rng(10 * n + k)
    pos = rng.random((n, dim))
    indptr, indices = neighbors.knn_graph(pos, k, exclude_self=exclude)
    _check_csr(indptr, indices, n)
    kk = min(k, n - 1 if exclude else n)
    assert np.all(np.diff(indptr) == kk)
    if kk == 0:
        return
    tree = cKDTree(pos)
    _, nb = tree.query(pos, kk + (1 if exclude else 0))
    nb = nb.reshape(n, -1)
    for i, row in enumerate(_rows(indptr, indices)):
        want = [j for j in nb[i] if not (exclude and j == i)][:kk]
        assert row == sorted(want), i


def test_knn_clustered_points():
    """Two far clusters: rings must keep growing until k neighbours are proven."""
    rng = np.random.default_rng(4)
    pos = np.concatenate([rng.random((50, 3)) * 0.01, 100 + rng.random((6, 3)) * 0.01])
    indptr, indices = neighbors.knn_graph(pos, 8)
    tree = cKDTree(pos)
    _, nb = tree.query(pos, 9)
    for i, row in enumerate(_rows(indptr, indices)):
        assert row == sorted(j for j in nb[i] if j != i)[:8]


def test_graph_radius_uses_cell_lists_and_keeps_positions():
    rng = np.random.default_rng(5)
    pos = rng.random((100, 3))
    g = Graph.radius(pos, 0.2)
    ip, ix = neighbors.radius_graph(pos, 0.2)
    # the graph's own copy: a later change of pos does not move its edge fields
    assert g.num_edges == ix.shape[0] and np.array_equal(g.positions, pos) and g.positions is not pos
    assert np.array_equal(g.realize("cpu").indices, ix)


def test_bad_inputs():
    with pytest.raises(ValueError, match="positions must have shape"):
        neighbors.radius_graph(np.zeros((4, 4)), 0.1)
    with pytest.raises(TypeError, match="positions must be a floating-point array"):
        neighbors.radius_graph(np.zeros((4, 3), np.int64), 0.1)
    for bad in (None, "abc", [["a", "b"]]):   # not numbers at all: the type, not the shape
        with pytest.raises(TypeError, match="positions must be a floating-point array"):
            Graph.radius(bad, 1.0)
    with pytest.raises(ValueError, match="cutoff must be finite and >= 0"):
        neighbors.radius_graph(np.zeros((4, 3)), -1.0)
    for bad in ("0.3", b"0.3", True, np.array("0.3"), None):   # float() would parse the strings
        with pytest.raises(TypeError, match="cutoff must be a real number"):
            Graph.radius(np.zeros((4, 3)), bad)
    assert Graph.radius(np.zeros((4, 3)), np.float32(0.5)).num_edges == 12   # numpy scalars are numbers
    with pytest.raises(ValueError, match="finite"):
        neighbors.radius_graph(np.array([[0.0, np.nan, 0.0]]), 1.0)
    with pytest.raises(ValueError, match="k must be >= 0"):
        neighbors.knn_graph(np.zeros((4, 3)), -2)
    with pytest.raises(TypeError, match="k must be an int"):
        neighbors.knn_graph(np.zeros((4, 3)), 2.5)
    # finite points whose span overflows float64: refused, not an endless grid search
    with pytest.raises(ValueError, match="positions span"):
        neighbors.radius_graph(np.array([[-1e308, 0.0], [1e308, 0.0]]), 1.0)
    with pytest.raises(ValueError, match="positions span"):
        neighbors.knn_graph(np.array([[-1e308], [1e308]]), 1)


def test_spatial_order_is_a_permutation():
    rng = np.random.default_rng(6)
    pos = rng.random((1000, 3))
    order = neighbors.spatial_order(pos)
    assert np.array_equal(np.sort(order), np.arange(1000))


def test_knn_ties_go_to_the_lower_index():
    """On a lattice many distances tie exactly: brute force with (distance, id) order."""
    g = np.stack(np.meshgrid(np.arange(5.0), np.arange(4.0), np.arange(3.0), indexing="ij"), -1)
    pos = g.reshape(-1, 3)
    rng = np.random.default_rng(7)
    pos = pos[rng.permutation(pos.shape[0])]
    k = 6
    indptr, indices = neighbors.knn_graph(pos, k)
    d2 = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1)
    for i, row in enumerate(_rows(indptr, indices)):
        cand = sorted((d2[i, j], j) for j in range(pos.shape[0]) if j != i)[:k]
        assert row == sorted(j for _, j in cand), i


def test_pair_at_exactly_the_cutoff_is_an_edge():
    """Lattice spacing 1, cutoff 1: every axis neighbour sits exactly on the cutoff sphere."""
    g = np.stack(np.meshgrid(np.arange(4.0), np.arange(3.0), np.arange(5.0), indexing="ij"), -1)
    pos = g.reshape(-1, 3) * 0.1  # 0.1 is not exact in binary: rounding decides the boundary
    ref = _ckdtree_radius(pos, 0.1, True)
    indptr, indices = neighbors.radius_graph(pos, 0.1)
    assert _rows(indptr, indices) == ref


# ------------------------------------------------------------------------- oracles and cases
def _ckdtree_radius(pos, cutoff, exclude):
    found = cKDTree(pos).query_ball_point(pos, cutoff)
    return [sorted(j for j in found[i] if not (exclude and j == i)) for i in range(pos.shape[0])]


def _brute_knn(pos, k, exclude):
    """Rows of the k best sources by (squared distance, id), sorted by id."""
    p = np.asarray(pos, np.float64)
    n = p.shape[0]
    d2 = ((p[:, None, :] - p[None, :, :]) ** 2).sum(-1)
    if exclude:
        d2[np.arange(n), np.arange(n)] = np.inf
    k = min(k, n - 1 if exclude else n)
    best = np.argsort(d2, axis=1, kind="stable")[:, :k]  # stable: ties go to the lower id
    return np.sort(best, axis=1).tolist()


def radius_cases(small):
    """(name, positions, cutoff, exclude_self): random clouds plus the edge cases."""
    rng = np.random.default_rng(2026 if small else 1129)
    n = 70 if small else 3001
    out = [("empty", np.zeros((0, 3)), 0.1, True), ("one", rng.random((1, 3)), 0.5, True),
           ("one_self", rng.random((1, 2)), 0.5, False)]
    for dim in (1, 2, 3):
        for dtype in (np.float32, np.float64):
            pos = rng.random((n + dim, dim)).astype(dtype)
            pos[:4] = pos[4]  # duplicates: distance 0, distinct ids
            cut = {1: 0.01, 2: 0.06, 3: 0.12}[dim] * (3.0 if small else 1.0)
            out.append((f"random_{dim}d_{np.dtype(dtype).name}", pos, cut, dim != 2))
    out.append(("one_cell", rng.random((n // 2, 3)) * 1e-3, 0.5, True))
    far = rng.random((n // 2, 3)) * 1e6
    far[1] = far[0] + 0.3
    out.append(("far_apart", far, 1.0, True))
    out.append(("cutoff_0", np.repeat(rng.random((n // 4, 3)), 2, axis=0), 0.0, True))
    out.append(("cutoff_0_self", rng.random((n // 4, 2)), 0.0, False))
    lattice = np.stack(np.meshgrid(*(np.arange(6.0),) * 3, indexing="ij"), -1).reshape(-1, 3)
    out.append(("lattice_exact", lattice * 0.1, 0.1, True))
    return out


def knn_cases(small):
    """(name, positions, k, exclude_self)."""
    rng = np.random.default_rng(7 if small else 77)
    n = 60 if small else 2500
    out = [("empty", np.zeros((0, 3)), 4, True), ("one", rng.random((1, 3)), 3, True),
           ("one_self", rng.random((1, 3)), 3, False), ("k_gt_n", rng.random((5, 3)), 10, True),
           ("k_0", rng.random((9, 3)), 0, True)]
    for dim in (1, 2, 3):
        for dtype in (np.float32, np.float64):
            pos = rng.random((n + dim, dim)).astype(dtype)
            pos[:3] = pos[3]
            out.append((f"random_{dim}d_{np.dtype(dtype).name}", pos, 5 if small else 16, dim == 3))
    lattice = np.stack(np.meshgrid(np.arange(5.0), np.arange(4.0), np.arange(3.0),
                                   indexing="ij"), -1).reshape(-1, 3)
    out.append(("lattice_ties", lattice[rng.permutation(lattice.shape[0])], 6, True))
    out.append(("clusters", np.concatenate([rng.random((n // 2, 3)) * 0.01,
                                            100 + rng.random((6, 3)) * 0.01]), 8, True))
    out.append(("one_point_repeated", np.ones((n // 3, 2)), 4, True))
    return out


def check_radius_case(build, name, pos, cutoff, exclude, oracle=True):
    """build(pos, cutoff, exclude) -> host (indptr, indices); compared with the host builder
    (exactly) and with cKDTree."""
    indptr, indices = build(pos, cutoff, exclude)
    want_ip, want_ix = neighbors.radius_graph(pos, cutoff, exclude_self=exclude)
    _check_csr(indptr, indices, pos.shape[0])
    assert np.array_equal(indptr, want_ip) and np.array_equal(indices, want_ix), name
    if oracle and pos.shape[0]:
        assert _rows(indptr, indices) == _ckdtree_radius(pos, cutoff, exclude), name


def check_knn_case(build, name, pos, k, exclude, oracle=True):
    indptr, indices = build(pos, k, exclude)
    want_ip, want_ix = neighbors.knn_graph(pos, k, exclude_self=exclude)
    _check_csr(indptr, indices, pos.shape[0])
    assert np.array_equal(indptr, want_ip) and np.array_equal(indices, want_ix), name
    if oracle and pos.shape[0]:
        assert _rows(indptr, indices) == _brute_knn(pos, k, exclude), name


@pytest.mark.parametrize("case", radius_cases(small=True), ids=lambda c: c[0])
def test_host_radius_cases_match_ckdtree(case):
    check_radius_case(lambda p, c, e: neighbors.radius_graph(p, c, exclude_self=e), *case)


@pytest.mark.parametrize("case", knn_cases(small=True), ids=lambda c: c[0])
def test_host_knn_cases_match_brute_force(case):
    check_knn_case(lambda p, k, e: neighbors.knn_graph(p, k, exclude_self=e), *case)


# ------------------------------------------------------------------------- GPU builder, no GPU
def _sim_main(which):
    """Run the GPU builder's kernels in the simulator on every small case."""
    from tiga_numba.cuda import neighbors as gpu
    if which == "radius":
        for case in radius_cases(small=True):
            check_radius_case(lambda p, c, e: gpu.radius_graph(p, c, e)[:2], *case)
    else:
        for case in knn_cases(small=True):
            check_knn_case(lambda p, k, e: gpu.knn_graph(p, k, e)[:2], *case)
    print("ALL OK")


@pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed")
@pytest.mark.parametrize("which", ["radius", "knn"])
def test_gpu_builder_in_simulator(which):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "sim", which], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed")
def test_gpu_builder_compiles_for_sm90_without_fma_or_local_memory():
    """Squared distances must round like the host's (no FMA contraction: a pair at the
    cutoff or a knn tie is decided the same way), and nothing may spill to local memory."""
    import re
    from tiga_numba.cuda import neighbors as gpu
    for kern in (gpu.make_radius_pass(False), gpu.make_radius_pass(True), gpu.make_knn_pass()):
        ptx = kern.compile_ptx(cc=(9, 0))
        assert ".target sm_90" in ptx and ".entry" in ptx, kern.name
        assert not re.search(r"\bfma\.rn\.f64", ptx), f"{kern.name}: fused multiply-add"
        assert "mul.rn.f64" in ptx, kern.name
        assert "ld.local" not in ptx and "st.local" not in ptx, f"{kern.name}: local memory"


# ------------------------------------------------------------------------- GPU builder, GPU
def _have_gpu():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


needs_gpu = pytest.mark.skipif(not _have_gpu(), reason="no cupy / CUDA device")


def _gpu_build(kind):
    import cupy

    def build(pos, arg, exclude):
        dpos = cupy.asarray(pos)
        g = (Graph.radius if kind == "radius" else Graph.knn)(dpos, arg, exclude_self=exclude)
        # the graph keeps its own device copy of the positions (a Graph is immutable)
        assert g.device == "cuda" and isinstance(g.positions, cupy.ndarray) and g.positions is not dpos
        assert bool((g.positions == dpos).all())
        rel = g.realize("cuda")
        assert isinstance(rel.indptr, cupy.ndarray) and isinstance(rel.indices, cupy.ndarray)
        assert g._indptr is None, "the device CSR went through the host"
        assert neighbors.last_build_info()["builder"] == "cuda"
        assert g.num_edges == int(rel.indices.shape[0])
        return rel.indptr.get(), rel.indices.get()
    return build


@pytest.mark.parametrize("case", radius_cases(small=False), ids=lambda c: c[0])
@pytest.mark.gpu
@needs_gpu
def test_gpu_radius_equals_host_and_ckdtree(case):
    check_radius_case(_gpu_build("radius"), *case)


@pytest.mark.parametrize("case", knn_cases(small=False), ids=lambda c: c[0])
@pytest.mark.gpu
@needs_gpu
def test_gpu_knn_equals_host_and_brute_force(case):
    check_knn_case(_gpu_build("knn"), *case, oracle=case[1].shape[0] <= 3000)


@pytest.mark.gpu
@needs_gpu
def test_gpu_graph_transpose_edge_fields_and_lazy_host_copy():
    import cupy
    rng = np.random.default_rng(11)
    pos = rng.random((777, 3)).astype(np.float32)
    g = Graph.radius(cupy.asarray(pos), 0.15)
    h = Graph.radius(pos, 0.15)
    t, th = g.realize_transpose("cuda"), h.realize_transpose("cpu")
    for a, b in ((t.indptr, th.indptr), (t.indices, th.indices), (t.perm, th.perm)):
        assert isinstance(a, cupy.ndarray) and a.dtype == b.dtype and np.array_equal(a.get(), b)
    disp = g.edge_field("displacement")
    assert isinstance(disp, cupy.ndarray)
    np.testing.assert_array_equal(disp.get(), h.edge_field("displacement"))
    # the 3-term sum may associate differently in cupy's reduction: one float32 rounding
    np.testing.assert_allclose(g.edge_field("distance").get(), h.edge_field("distance"), rtol=1e-6)
    assert g._indptr is None and "cuda" in g.explain()
    ip, ix = g._host_csr()  # a host consumer asks: made once, then kept
    assert np.array_equal(ip, h._host_csr()[0]) and np.array_equal(ix, h._host_csr()[1])
    assert g._host_csr()[0] is ip
    assert np.array_equal(g.realize("cpu").indices, ix)
    e = Graph.knn(cupy.zeros((0, 3)), 3)
    assert e.num_edges == 0 and e.realize_transpose("cuda").indptr.shape == (1,)


@pytest.mark.gpu
@needs_gpu
def test_gpu_bad_inputs_name_the_argument():
    import cupy
    with pytest.raises(ValueError, match="positions must have shape"):
        Graph.radius(cupy.zeros((4, 4)), 0.1)
    with pytest.raises(TypeError, match="positions must be a floating-point array"):
        Graph.knn(cupy.zeros((4, 3), cupy.int32), 2)
    with pytest.raises(ValueError, match="positions must be finite"):
        Graph.radius(cupy.asarray([[0.0, np.inf, 0.0]]), 0.1)
    with pytest.raises(ValueError, match="cutoff must be finite and >= 0"):
        Graph.radius(cupy.zeros((4, 3)), -0.5)
    with pytest.raises(TypeError, match="cutoff must be a real number"):
        Graph.radius(cupy.zeros((4, 3)), "big")
    with pytest.raises(TypeError, match="k must be an int"):
        Graph.knn(cupy.zeros((4, 3)), 1.5)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "sim":
        import sim_support
        sim_support.prepare_simulator()
        _sim_main(sys.argv[2])
