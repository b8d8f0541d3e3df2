"""GPU tests of score modifiers on the CUDA-core kernels (marked gpu; skipped without cupy and
a CUDA device): the CPU tests of tests/test_score_mods.py with cupy inputs, against the same
float64 oracle -- every relation kind, forward and every gradient, classic GAT without a dot
product, edge fields on CSR, float32, the functional soft-cap / ALiBi -- plus what only the GPU
path has: the registry's choice and refusals in explain(), long CSR rows split into pieces, and
the same bits on a repeated backward."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu


from test_cuda_gpu import _shield  # noqa: E402

_shield()
import tiga_numba as tg  # noqa: E402
from tiga_numba import functional  # noqa: E402

import test_score_mods as tsm  # noqa: E402

RNG = np.random.default_rng(17)


def _to(x):
    return cupy.asarray(x) if isinstance(x, np.ndarray) else x


def _host(tree):
    if isinstance(tree, dict):
        return {k: _host(v) for k, v in tree.items()}
    return cupy.asnumpy(tree) if isinstance(tree, cupy.ndarray) else tree


def _run_gpu(fn, graph, dtype, H=4, Hkv=2, D=5, dot=True, node_shapes=("N", "NH"),
             edge_fields=(), **params):
    """tsm._run_program_once with cupy inputs: (program, out, grads, oracle out, oracle grads);
    inputs putting an edge on a kink of fn are drawn again."""
    for _ in range(8):
        try:
            return _run_gpu_once(fn, graph, dtype, H, Hkv, D, dot, node_shapes, edge_fields, params)
        except tsm._NearKink:
            continue
    raise AssertionError("eight draws of random inputs all put an edge on a kink of fn")


def _run_gpu_once(fn, graph, dtype, H, Hkv, D, dot, node_shapes, edge_fields, params):
    n_dst, n_src = graph.num_dst, graph.num_src
    src, dst, edge = {}, {}, {}
    if dot:
        dst["query"] = RNG.standard_normal((n_dst, H, D))
        src["key"] = RNG.standard_normal((n_src, Hkv, D))
    src["value"] = RNG.standard_normal((n_src, Hkv if dot else H, 3))
    if "a" in fn.__code__.co_names:
        shp_d, shp_s = node_shapes
        dst["a"] = RNG.standard_normal((n_dst,) if shp_d == "N" else (n_dst, H))
        src["a"] = RNG.standard_normal((n_src,) if shp_s == "N" else (n_src, H))
    for name in edge_fields:
        edge[name] = RNG.standard_normal((graph.num_edges, H) if name == "b" else graph.num_edges)
    cast = {r: {n: cupy.asarray(a.astype(dtype)) for n, a in d.items()} for r, d in
            (("src", src), ("dst", dst), ("edge", edge))}
    prog = tsm.ModProgram(fn, dot)
    out, vjp = prog.vjp(graph=graph, src=cast["src"], dst=cast["dst"], edge=cast["edge"],
                        scale=0.4, **{n: _to(v) for n, v in params.items()})
    dout = RNG.standard_normal(out.shape)
    grads = _host(vjp(cupy.asarray(dout.astype(dtype))))
    want, wgrads = tsm.oracle(fn, graph, dst.get("query"), src.get("key"), src["value"], dout, 0.4,
                              {n: a for n, a in src.items() if n not in ("key", "value")},
                              {n: a for n, a in dst.items() if n != "query"}, edge,
                              {n: (np.asarray(v, np.float64) if isinstance(v, np.ndarray) else v)
                               for n, v in params.items()}, dot=dot)
    return prog, cupy.asnumpy(out), grads, want, wgrads


@pytest.mark.parametrize("rel", sorted(tsm.RELATIONS))
def test_gpu_modifier_forward_and_gradients_on_every_relation(rel):
    g = tsm.RELATIONS[rel]
    prog, out, grads, want, wgrads = _run_gpu(tsm._full_mod, g, np.float64, c=2.5,
                                              slopes=RNG.uniform(0.2, 1.0, 4))
    tsm._check_all(out, grads, want, wgrads, 1e-6)
    plan = functional.last_plan()
    assert plan.family == ("cuda.csr" if rel == "csr" else "cuda.blocks"), plan.family
    assert plan.modifier is not None
    assert "cuda.tc refused (" in plan.explain()   # float64 (and param gradients) stay on the CUDA cores
    assert "compiled score modifier" in plan.run_info["kernel"]


@pytest.mark.parametrize("rel", ["dense", "segments-rect", "band", "csr"])
def test_gpu_classic_gat_score_without_dot_product(rel):
    prog, out, grads, want, wgrads = _run_gpu(tsm._gat_mod, tsm.RELATIONS[rel], np.float64,
                                              dot=False, node_shapes=("NH", "NH"))
    tsm._check_all(out, grads, want, wgrads, 1e-6)
    assert functional.last_plan().head_dim == 0  # no dot product: zero-width q and k


@pytest.mark.parametrize("rel", ["triangular", "csr"])
def test_gpu_whole_and_half_powers_are_written_out(rel):
    """x ** n, np.square, np.power and x ** 0.5 written out as products / np.sqrt on the GPU
    kernels, forward and every gradient, against the float64 oracle."""
    prog, out, grads, want, wgrads = _run_gpu(tsm._power_mod, tsm.RELATIONS[rel], np.float64,
                                              node_shapes=("NH", "N"))
    tsm._check_all(out, grads, want, wgrads, 1e-6)


def test_gpu_edge_fields_in_a_modifier_on_csr():
    prog, out, grads, want, wgrads = _run_gpu(tsm._edge_mod, tsm.RELATIONS["csr"], np.float64,
                                              edge_fields=("b", "w"))
    tsm._check_all(out, grads, want, wgrads, 1e-6)


@pytest.mark.parametrize("rel", ["segments-rect", "csr"])
def test_gpu_float32_modifier_matches_the_float64_oracle(rel):
    prog, out, grads, want, wgrads = _run_gpu(tsm._full_mod, tsm.RELATIONS[rel], np.float32,
                                              c=2.5, slopes=RNG.uniform(0.2, 1.0, 4))
    tsm._check_all(out, grads, want, wgrads, 2e-4)


@pytest.mark.parametrize("rel, dtype", [("dense-rect", np.float64), ("segments-rect", np.float64),
                                        ("triangular", np.float64), ("csr", np.float64),
                                        ("segments-rect", np.float32), ("dense", np.float16)])
def test_gpu_functional_softcap_and_alibi_match_flash_attn_conventions(rel, dtype):
    g = tsm.RELATIONS[rel]
    H, Hkv, D = 4, 2, 64 if dtype == np.float16 else 6
    q = RNG.standard_normal((g.num_dst, H, D)) * (0.3 if D == 64 else 2)
    k = RNG.standard_normal((g.num_src, Hkv, D)) * (0.3 if D == 64 else 2)
    v = RNG.standard_normal((g.num_src, Hkv, 3))
    dout = RNG.standard_normal((g.num_dst, H, 3))
    slopes = RNG.uniform(0.1, 0.6, H)
    cap = 1.5
    shift = tsm._flash_shift(rel, g)
    c = [cupy.asarray(x.astype(dtype)) for x in (q, k, v)]
    qr, kr, vr = (cupy.asnumpy(x).astype(np.float64) for x in c)  # the oracle sees the rounded inputs

    def fn(s, src, dst, edge, p):
        i = dst.index + shift[dst.index]
        return cap * np.tanh(s / cap) - slopes * np.abs(i - src.index)

    want, wg = tsm.oracle(fn, g, qr, kr, vr, dout, D ** -0.5, {}, {}, {}, {})
    sl = cupy.asarray(slopes.astype(dtype if dtype != np.float16 else np.float32))
    out, stats = tg.attention(*c, g, softcap=cap, alibi_slopes=sl, return_stats=True)
    plan = functional.last_plan()
    assert plan.family in ("cuda.blocks", "cuda.csr"), plan.explain()
    dq, dk, dv = tg.attention_backward(cupy.asarray(dout.astype(dtype)), *c, out, stats, g,
                                       softcap=cap, alibi_slopes=sl)
    tol = {np.float64: 1e-9, np.float32: 2e-4, np.float16: 2e-2}[dtype]
    tsm._close(cupy.asnumpy(out), want, tol, "out")
    tsm._close(cupy.asnumpy(dq), wg["dst"]["query"], max(tol, 1e-6), "dq")
    tsm._close(cupy.asnumpy(dk), wg["src"]["key"], max(tol, 1e-6), "dk")
    tsm._close(cupy.asnumpy(dv), wg["src"]["value"], tol, "dv")


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_gpu_per_sequence_alibi_slopes(dtype):
    """flash-attn's (batch, H) slopes on a rectangular cu_seqlens relation (one sequence empty):
    the CUDA-core kernels (float64) and the tensor-core kernels (float16, D = 128: the kernels
    benchmarks/gpu/tc_mods_sanitize.py runs) against the CPU kernels' float64 call on the same
    rounded inputs, forward and backward."""
    cu, cu_k = np.array([0, 130, 130, 300, 301]), np.array([0, 150, 170, 330, 400])
    g = tg.Graph.cu_seqlens(cu, cu_seqlens_k=cu_k, causal=True)
    H, Hkv, D = 4, 2, 128
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((n, h, D)) * 0.5 for n, h in ((301, H), (400, Hkv), (400, Hkv)))
    dout = rng.standard_normal((301, H, D))
    slopes = rng.uniform(0.01, 0.2, (4, H))
    c = [cupy.asarray(x.astype(dtype)) for x in (q, k, v, dout)]
    r = [cupy.asnumpy(x).astype(np.float64) for x in c]
    sl = cupy.asarray(slopes.astype(np.float32 if dtype == np.float16 else dtype))
    out, stats = tg.attention(*c[:3], g, alibi_slopes=sl, return_stats=True)
    family = functional.last_plan().family
    assert family == ("cuda.tc" if dtype == np.float16 else "cuda.blocks"), functional.last_plan().explain()
    grads = tg.attention_backward(c[3], *c[:3], out, stats, g, alibi_slopes=sl)
    want, wst = tg.attention(*r[:3], g, alibi_slopes=cupy.asnumpy(sl).astype(np.float64),
                             return_stats=True)
    wgrads = tg.attention_backward(r[3], *r[:3], want, wst, g, alibi_slopes=cupy.asnumpy(sl).astype(np.float64))
    tol = 1e-9 if dtype == np.float64 else 2e-2
    tsm._close(cupy.asnumpy(out), want, tol, "out")
    for name, a, b in zip(("dq", "dk", "dv"), grads, wgrads):
        tsm._close(cupy.asnumpy(a), b, tol, name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpu_per_sequence_sums_are_the_host_sums_bit_for_bit(dtype):
    """The per-sequence slopes' gradient summed on the device (score_mod._sum_runs with cupy
    rows) has the bits of the numpy call's sums (cpu/segments.py): runs of 0, 1 and many rows,
    values of very different sizes, a run of -0.0 only (keeps its sign), (N, H) and (N,) rows."""
    from tiga_numba import score_mod
    rng = np.random.default_rng(23)
    index = np.repeat(np.arange(9), [3, 0, 1, 500, 0, 2, 37, 1, 0])
    for shape in ((index.size, 5), (index.size,)):
        g = rng.standard_normal(shape).astype(dtype) * rng.choice([1e-6, 1.0, 1e8], shape).astype(dtype)
        g[:3] = -0.0
        want = score_mod._sum_runs(g, index, 10)   # numpy: cpu/segments.py
        for idx in (index, cupy.asarray(index)):
            got = score_mod._sum_runs(cupy.asarray(g), idx, 10)
            assert isinstance(got, cupy.ndarray) and got.dtype == np.float64 and got.shape == want.shape
            assert np.array_equal(cupy.asnumpy(got).view(np.int64), want.view(np.int64))
        assert np.signbit(want[0]).all() and (want[[1, 4, 8, 9]] == 0).all()


def test_gpu_modifier_on_split_rows_repeats_bit_for_bit():
    """A destination row and a source column longer than a piece (split, merged in slot order)
    with dst / src / edge fields and per-head params: oracle match and the same bits twice."""
    import scipy.sparse as sps
    n_dst, n_src = 1100, 1500   # hub row and hub source longer than a piece (1024 edges)
    rng = np.random.default_rng(4)
    mask = rng.random((n_dst, n_src)) < 0.002
    mask[7] = True        # a hub row: every source
    mask[:, 11] = True    # a hub source: every row
    mask[3] = False       # an empty row
    g = tg.Graph.from_scipy(sps.csr_matrix(mask.astype(np.float64)))

    def fn(s, src, dst, edge, p):
        return p["w"] * np.tanh(s + src.a) + dst.a * edge.b

    res = []
    for _ in range(2):
        prog, out, grads, want, wgrads = _run_gpu(fn, g, np.float64, w=RNG.uniform(0.5, 1.0, 4),
                                                  node_shapes=("NH", "N"), edge_fields=("b",))
        tsm._check_all(out, grads, want, wgrads, 1e-6)
        res.append(grads)
    kernel = functional.last_plan().run_info["kernel"]
    assert "dq: rows ordered by length, 1 row(s)" in kernel and "dk/dv: rows ordered by length, 1 row(s)" in kernel, kernel
    # same inputs twice: same bits (no float atomics anywhere)
    src = {"key": cupy.asarray(rng.standard_normal((n_src, 2, 5))),
           "value": cupy.asarray(rng.standard_normal((n_src, 2, 3))),
           "a": cupy.asarray(rng.standard_normal((n_src, 4)))}
    dst = {"query": cupy.asarray(rng.standard_normal((n_dst, 4, 5))),
           "a": cupy.asarray(rng.standard_normal(n_dst))}
    edge = {"b": cupy.asarray(rng.standard_normal((g.num_edges, 4)))}
    w = cupy.asarray(rng.uniform(0.5, 1.0, 4))
    dout = cupy.asarray(rng.standard_normal((n_dst, 4, 3)))
    runs = []
    for _ in range(2):
        out, vjp = tsm.ModProgram(fn).vjp(graph=g, src=src, dst=dst, edge=edge, scale=0.4, w=w)
        runs.append((_host(out), _host(vjp(dout))))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for role in ("src", "dst", "edge", "params"):
        for n in runs[0][1][role]:
            np.testing.assert_array_equal(runs[0][1][role][n], runs[1][1][role][n])


def _masked_rows(s, src, dst, edge, p):
    """rows 0, 1 and 7 masked by their scores alone (-inf on every edge), a soft-cap elsewhere"""
    capped = 1.5 * np.tanh(s / 1.5)
    return np.where(dst.index < 2, -np.inf, np.where(dst.index == 7, -np.inf, capped))


@pytest.mark.parametrize("rel, dtype", [("segments-rect", np.float32), ("csr", np.float64),
                                        ("triangular", np.float16)])
def test_gpu_rows_the_modifier_masks_entirely_are_empty_rows(rel, dtype):
    """A row whose every edge the modifier masks is an empty row on every GPU family, as on the
    CPU: output 0, l = 0, no gradient through it (the CUDA-core kernels, and float16 on the
    tensor cores); never a uniform softmax over its masked edges."""
    g = tsm.RELATIONS[rel]
    H, Hkv, D = 4, 2, 64 if dtype == np.float16 else 6
    q = RNG.standard_normal((g.num_dst, H, D)) * (0.3 if D == 64 else 1)
    k = RNG.standard_normal((g.num_src, Hkv, D)) * (0.3 if D == 64 else 1)
    DV = D if dtype == np.float16 else 8
    v = RNG.standard_normal((g.num_src, Hkv, DV))
    dout = RNG.standard_normal((g.num_dst, H, DV))
    host = [x.astype(dtype) for x in (q, k, v, dout)]
    prog = tsm.ModProgram(_masked_rows, True)
    res = []
    for xp in (np, cupy):
        qd, kd, vd, dod = (xp.asarray(x) for x in host)
        out, vjp = prog.vjp(graph=g, src={"key": kd, "value": vd}, dst={"query": qd}, scale=D ** -0.5)
        grads = vjp(dod)
        res.append([_host(x) for x in (out, grads["dst"]["query"], grads["src"]["key"],
                                       grads["src"]["value"])])
        if xp is cupy:
            plan = functional.last_plan()
            if dtype == np.float16:
                assert plan.family == "cuda.tc", plan.explain()
    rows = [0, 1, 7]
    assert (res[1][0][rows] == 0).all(), "a row the modifier masks entirely is not an empty row"
    assert (res[1][1][rows] == 0).all(), "dq of an empty row"
    tol = {np.float64: 1e-9, np.float32: 2e-4, np.float16: 2e-2}[dtype]
    for name, got, want in zip(("out", "dq", "dk", "dv"), res[1], res[0]):
        assert np.isfinite(got).all(), name
        tsm._close(got, want, tol, name)


def _nan_inf_alibi(s, src, dst, edge, p):
    """NaN values beyond 8 keys back, +inf 3 keys back, under a constant-slope ALiBi penalty: on a
    causal relation the tensor-core forward splits the distance and clamps only where a warp needs
    it (NaN cells masked, infinite ones tied at the ceiling)"""
    d = dst.index - src.index
    return np.where(d > 8, np.log(-np.abs(s) - 1.0), np.where(d == 3, np.inf, s)) - 0.25 * np.abs(d)


def test_gpu_nan_and_infinite_values_on_the_tensor_cores():
    """the guarded forward (softmax.guarded_softmax) with ALiBi's split, float16 on the tensor
    cores, against the CPU's float16 call: NaN cells masked, +inf cells tied (weight 1 for the one
    of each row), gradients finite and equal."""
    g = tsm.RELATIONS["triangular"]
    H, Hkv, D = 4, 2, 64
    host = [RNG.standard_normal(s).astype(np.float16) * np.float16(0.3) for s in
            ((g.num_dst, H, D), (g.num_src, Hkv, D), (g.num_src, Hkv, D), (g.num_dst, H, D))]
    prog = tsm.ModProgram(_nan_inf_alibi, True)
    res = []
    for xp in (np, cupy):
        qd, kd, vd, dod = (xp.asarray(x) for x in host)
        out, vjp = prog.vjp(graph=g, src={"key": kd, "value": vd}, dst={"query": qd}, scale=D ** -0.5)
        if xp is cupy:
            plan = functional.last_plan()
            assert plan.family == "cuda.tc" and "taken as the signed distance" in plan.explain(), plan.explain()
        grads = vjp(dod)
        res.append([_host(x) for x in (out, grads["dst"]["query"], grads["src"]["key"], grads["src"]["value"])])
    for name, got, want in zip(("out", "dq", "dk", "dv"), res[1], res[0]):
        assert np.isfinite(got).all(), name
        tsm._close(got, want, 2e-2, name)
