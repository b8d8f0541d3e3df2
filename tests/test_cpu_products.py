"""The CPU block kernels' tile products: cpu/microgemm.py's register-blocked kernel against the
BLAS and the float64 oracle (row tails, transposed A, accumulate or overwrite, strided views,
shapes it does not take), attention through either choice, thread-count independent bits, and the
per-machine choice's on-disk calibration (a corrupt or foreign file is ignored with a warning)."""
import json
import warnings

import numpy as np
import pytest
from numba import njit

import tiga_numba as tg
from tiga_numba import reference
from tiga_numba.cpu import microgemm as mg
from tiga_numba.cpu.gemm import mm

own_kernel = pytest.mark.skipif(mg.LANES == 0, reason="no AVX2 / AVX-512: the own kernel is never chosen")


@njit
def _own(a, b, c, beta, trans_a):
    mg.product(a, b, c, beta, trans_a, False, True)


@njit
def _blas(a, b, c, beta, trans_a):
    mm(a, b, c, beta, trans_a, False)


@own_kernel
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 64, 64), (5, 3, 128), (7, 64, 256), (64, 200, 128), (250, 64, 64),
                                   (13, 17, 48)])   # 48 columns: not the kernel's, the BLAS runs
def test_own_product_matches_blas_and_float64(M, K, N, trans_a):
    rng = np.random.default_rng(M * 7 + K + N)
    a_full = rng.standard_normal((K + 3, M + 5) if trans_a else (M + 3, K + 5)).astype(np.float32)
    a = a_full[1:K + 1, 2:M + 2] if trans_a else a_full[1:M + 1, 2:K + 2]   # strided views
    b = rng.standard_normal((K, N + 64)).astype(np.float32)[:, :N]
    c0 = rng.standard_normal((M, N + 16)).astype(np.float32)
    want = (a.T if trans_a else a).astype(np.float64) @ b.astype(np.float64)
    for beta in (0.0, 1.0):
        got, ref = c0.copy()[:, :N], c0.copy()[:, :N]
        _own(a, b, got, beta, trans_a)
        _blas(a, b, ref, beta, trans_a)
        exact = want + beta * c0[:, :N]
        scale = np.abs(exact).max()
        assert np.abs(got - exact).max() <= 2e-6 * scale * max(K, 1) ** 0.5
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)


GRAPHS = {
    "dense": lambda: tg.Graph.dense(300, 260),
    "causal": lambda: tg.Graph.triangular(333),
    "segments": lambda: tg.Graph.cu_seqlens([0, 1, 1, 70, 200, 333]),
    "band": lambda: tg.Graph.band(333, left=90),
}


@own_kernel
@pytest.mark.parametrize("name", list(GRAPHS))
def test_attention_is_the_same_with_either_tile_product(name, monkeypatch):
    """D = 64 (the own kernel takes the 64- and 128-wide products), GQA, tails: forward and every
    gradient with the own kernel, with the BLAS and against the float64 oracle; explain() names
    the product that ran."""
    g = GRAPHS[name]()
    rng = np.random.default_rng(len(name))
    H, Hkv, D = 4, 2, 64
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in
                   ((g.num_dst, H, D), (g.num_src, Hkv, D), (g.num_src, Hkv, D), (g.num_dst, H, D)))
    res = {}
    for which in ("own", "blas"):
        with tg.options(cpu_tiles=(64, 128), cpu_products=which):
            out, st = tg.attention(q, k, v, g, return_stats=True)
            assert f"tile products: {'own' if which == 'own' else 'BLAS'}" in tg.explain()
            res[which] = (out,) + tuple(tg.attention_backward(do, q, k, v, out, st, g))
    want = (reference.attention(q, k, v, g),) + tuple(reference.attention_backward(do, q, k, v, g)[:3])
    for got_own, got_blas, ref in zip(res["own"], res["blas"], want):
        scale = np.abs(ref).max()
        np.testing.assert_allclose(got_own, ref, rtol=0, atol=3e-5 * scale)
        np.testing.assert_allclose(got_own, got_blas, rtol=0, atol=3e-5 * scale)


@own_kernel
@pytest.mark.parametrize("poison_v", [False, True])
def test_span_tiles_read_k_transposed_and_keys_past_the_band_never_leak(poison_v):
    """The machine's band tiles (64 query rows x the band's keys, not packed) take the own product
    on K^T over a whole number of its column blocks: rows 64..127 of a left=40 band span keys
    24..127, read as 24..151. A NaN in k at key 140 (and an inf in v at 141) lies inside that read
    but outside those rows' band: rows before 140 must match the oracle on clean inputs."""
    g = tg.Graph.band(333, left=40)
    rng = np.random.default_rng(11)
    H, Hkv, D = 4, 2, 64
    q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in
                   ((333, H, D), (333, Hkv, D), (333, Hkv, D), (333, H, D)))
    clean_k, clean_v = k.copy(), v.copy()
    k[140, 0, 3] = np.nan
    if poison_v:
        v[141, 1, 5] = np.inf
    with tg.options(cpu_products="own"):
        out, st = tg.attention(q, k, v, g, return_stats=True)
        text = tg.explain()
        dq = tg.attention_backward(do, q, k, v, out, st, g)[0]
    assert "K^T: unpacked key tiles" in text and "BM=64" in text, text
    ref = reference.attention(q, clean_k, clean_v, g)
    ref_dq = reference.attention_backward(do, q, clean_k, clean_v, g)[0]
    rows = slice(0, 140)
    for got, want in ((out, ref), (dq, ref_dq)):
        assert np.all(np.isfinite(got[rows]))
        np.testing.assert_allclose(got[rows], want[rows], rtol=0, atol=3e-5 * np.abs(want).max())


@own_kernel
def test_backward_bits_do_not_depend_on_the_thread_count_with_the_own_product(monkeypatch):
    import numba
    g = tg.Graph.triangular(400)
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((400, 2, 64)).astype(np.float32) for _ in range(4))
    got = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            with tg.options(cpu_products="own"):
                out, st = tg.attention(q, k, v, g, return_stats=True)
                got.append((out,) + tuple(tg.attention_backward(do, q, k, v, out, st, g)))
                assert "tile products: own" in tg.explain()
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for x, y in zip(*got):
        assert np.array_equal(x, y)


def test_the_choice_reads_a_valid_calibration_and_ignores_a_bad_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TIGA_NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mg, "LANES", 16)
    monkeypatch.setattr(mg, "_CHOICE", {})
    timed = []
    monkeypatch.setattr(mg, "calibrate", lambda: timed.append(1) or (150.0, 100.0))
    path = tmp_path / "cpu_products.json"
    assert mg.choice()[0] == "own" and timed == [1]          # nothing on disk: timed, written
    rec = json.loads(path.read_text())
    assert rec["machine"] == mg._machine() and rec["choice"] == "own"
    monkeypatch.setattr(mg, "_CHOICE", {})
    path.write_text(json.dumps(dict(rec, choice="blas", own_gflops=1.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # a valid file: read, no warning
        assert mg.choice()[0] == "blas" and timed == [1]
    for bad in ("{not json", json.dumps(dict(rec, machine=dict(rec["machine"], cpu="another"))),
                json.dumps(dict(rec, choice="fastest")),
                json.dumps({k: v for k, v in rec.items() if k != "own_gflops"})):   # a field missing
        monkeypatch.setattr(mg, "_CHOICE", {})
        path.write_text(bad)
        with pytest.warns(RuntimeWarning, match="ignoring"):
            assert mg.choice()[0] == "own"                   # timed again, the bad file replaced
        assert json.loads(path.read_text())["choice"] == "own"
    assert timed == [1, 1, 1, 1, 1]
    monkeypatch.setattr(mg, "_CHOICE", {})
    monkeypatch.setattr(mg, "calibrate", lambda: (100.0, 100.0))   # not 5 % faster: the BLAS
    path.unlink()
    assert mg.choice()[0] == "blas"


def test_the_choice_can_be_forced_and_refuses_unknown_names(monkeypatch):
    from tiga_numba import run_options
    monkeypatch.setattr(mg, "_CHOICE", {})
    monkeypatch.setattr(mg, "calibrate", lambda: pytest.fail("a forced choice times nothing"))
    monkeypatch.setattr(mg, "LANES", 16)
    for name in ("own", "blas"):
        assert mg.choice(name)[0] == name
        with tg.options(cpu_products=name):
            assert run_options.current().cpu_products == name
    with pytest.raises(ValueError, match="cpu_products"):
        with tg.options(cpu_products="fastest"):
            pass
    with pytest.raises(ValueError, match="TIGA_NUMBA_CPU_PRODUCTS"):   # the environment default, checked alike
        run_options._check_products("fastest", "TIGA_NUMBA_CPU_PRODUCTS")
    monkeypatch.setattr(mg, "LANES", 0)   # no vector unit for it: always the BLAS
    monkeypatch.setattr(mg, "_CHOICE", {})
    assert mg.choice("own")[0] == "blas"


_AVX2_CHECK = r"""
import llvmlite.binding as llb
real = llb.get_host_cpu_features


def without_avx512():   # numba compiles for these features too: AVX2 code
    features = real()
    for name in list(features):
        if name.startswith("avx512"):
            features[name] = False
    return features


llb.get_host_cpu_features = without_avx512
import numpy as np
from numba import njit
from tiga_numba.cpu import microgemm as mg
assert (mg.LANES, mg.NR) == (8, 16), (mg.LANES, mg.NR)

@njit
def own(a, b, c, beta, ta):
    mg.product(a, b, c, beta, ta, False, True)

rng = np.random.default_rng(0)
for M, K, N in ((7, 64, 16), (64, 33, 128), (13, 5, 48), (1, 1, 32)):
    for ta in (False, True):
        a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
        b = rng.standard_normal((K, N)).astype(np.float32)
        c = rng.standard_normal((M, N)).astype(np.float32)
        want = c.astype(np.float64) + (a.T if ta else a).astype(np.float64) @ b
        own(a, b, c, 1.0, ta)
        assert np.abs(c - want).max() <= 1e-5 * np.abs(want).max(), (M, K, N, ta)
print("avx2 ok")
"""


@pytest.mark.skipif(mg.LANES != 16, reason="checks the AVX2 kernel on an AVX-512 machine")
def test_the_avx2_kernel_on_this_machine(tmp_path):
    """The 6 x 16 AVX2 kernel (what a machine without AVX-512 runs) compiled here by hiding AVX-512
    from the feature query, in a process with its own numba cache (the kernels' cache does not key
    on the vector width the module chose)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), TIGA_NUMBA_CACHE_DIR=str(tmp_path / "tiga"))
    run = subprocess.run([sys.executable, "-c", _AVX2_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "avx2 ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("features,lanes", [("-avx512f,+avx2,+fma", 8), ("-avx512f,-avx2,+fma", 0),
                                            ("+avx512f,+avx2,+fma", 16)])
def test_vector_width_follows_numbas_target_not_the_host(features, lanes, tmp_path):
    """The own kernel's vectors are those of the target numba compiles for (NUMBA_CPU_FEATURES,
    e.g. a portable or another machine's target), not the host's: a process whose target lacks
    AVX2 gets no own kernel (the BLAS, said so by choice(), nothing timed), one without AVX-512 the
    AVX2 width, and a calibration record would name the target CPU. (Nothing is compiled here.)"""
    import os
    import subprocess
    import sys
    code = ("from tiga_numba.cpu import microgemm as m; import json; "
            "print(json.dumps([m.LANES, m.NR, m._machine()['cpu'], m.choice()[0] if m.LANES == 0 else None]))")
    env = dict(os.environ, NUMBA_CPU_NAME="x86-64-v2", NUMBA_CPU_FEATURES=features,
               TIGA_NUMBA_CACHE_DIR=str(tmp_path))
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    width, nr, cpu, products = json.loads(got.stdout.strip().splitlines()[-1])
    assert width == lanes and cpu == "x86-64-v2"
    assert lanes == 0 or nr == {16: 64, 8: 16}[lanes]   # (no own kernel: no block width)
    assert products == ("blas" if lanes == 0 else None)


@njit
def _panels(a, bpan, c, beta, trans_a):
    mg.product_panels(a, bpan, c, beta, trans_a)


@njit
def _in_place(a, b, c, beta, trans_a):
    mg.mm_own(a, b, c, beta, trans_a)


@own_kernel
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("M,K,blocks", [(1, 64, 1), (7, 64, 4), (13, 17, 2), (250, 64, 1), (50, 256, 3)])
def test_column_panels_give_the_bits_of_the_product_in_place(M, K, blocks, trans_a):
    """B packed by the kernels' packers (rows of a head-major array, and transposed key tiles with a
    zero tail) and read as column panels: every element is the same fused multiply-add chain as
    with B read in place, so the bits agree exactly (the forward and the backward rely on it)."""
    from tiga_numba.cpu import blocks as bl
    NR = mg.NR
    N = blocks * NR
    rng = np.random.default_rng(M + 3 * K + blocks)
    a_full = rng.standard_normal((K + 2, M + 3) if trans_a else (M + 2, K + 3)).astype(np.float32)
    a = a_full[1:K + 1, :M] if trans_a else a_full[1:M + 1, :K]
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    # rows n0..n0+K of a head-major (H, N_rows, N) array as B (dv's, dk's and dq's products)
    xh = rng.standard_normal((2, K + 9, N)).astype(np.float32)
    rows = np.empty((2, N // NR, K + 9, NR), np.float32)
    bl.pack_row_panels(xh, rows)
    # a key tile of `cols` keys starting at key 5 as B = K^T, zero past its keys (S = Q K^T)
    kh = rng.standard_normal((2, N + 11, K)).astype(np.float32)
    cols = N - NR // 2
    tiles = np.empty((2, N // NR, K, NR), np.float32)
    bl.pack_transposed_tiles(kh, np.array([5]), np.array([cols]), N, tiles)
    kt = np.zeros((K, N), np.float32)
    kt[:, :cols] = kh[1, 5:5 + cols].T
    for beta in (0.0, 1.0):
        for bpan, b in ((rows[1, :, 4:4 + K], xh[1, 4:4 + K]), (tiles[1], kt)):
            got, want = c0.copy(), c0.copy()
            _panels(a, bpan, got, beta, trans_a)
            _in_place(a, np.ascontiguousarray(b), want, beta, trans_a)
            np.testing.assert_array_equal(got, want)
            exact = (a.T if trans_a else a).astype(np.float64) @ b.astype(np.float64) + beta * c0
            assert np.abs(got - exact).max() <= 2e-6 * np.abs(exact).max() * K ** 0.5
