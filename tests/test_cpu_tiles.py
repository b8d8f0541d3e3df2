"""CPU tile shapes: the machine's rule, the cpu_tiles option and its validation; every tile
choice gives the oracle's results (forward and backward, every block relation kind, tails in
both directions), and the backward keeps the same bits across thread counts."""
import subprocess
import sys

import numpy as np
import pytest

import tiga_numba as tg
from conftest import attention_oracle
from tiga_numba.cpu import tiles

RNG = np.random.default_rng(5)
N = 600   # several 256-row / 256-key tiles, with tails


def _relations():
    return {
        "dense-rect": tg.Graph.dense(N - 77, N),
        "triangular": tg.Graph.triangular(N),
        "segments": tg.Graph.cu_seqlens(np.array([0, 300, 300, 301, N]), causal=True),
        "band": tg.Graph.band(N, left=300, right=20),
    }


RELATIONS = _relations()


def test_rule_picks_square_tiles_that_fit_half_the_l2(monkeypatch):
    for l2, want in ((1 << 20, 256), (512 << 10, 256), (256 << 10, 128), (64 << 10, 64)):
        monkeypatch.setattr(tiles, "_MACHINE", [])
        monkeypatch.setattr(tiles, "_l2_bytes", lambda l2=l2: l2)
        BM, BN, why = tiles.machine_tiles()
        assert (BM, BN) == (want, want) and f"L2 {l2 // 1024} KiB" in why
    monkeypatch.setattr(tiles, "_MACHINE", [])
    monkeypatch.setattr(tiles, "_l2_bytes", lambda: None)
    assert tiles.machine_tiles()[:2] == (128, 128) and "assumed" in tiles.machine_tiles()[2]


def test_option_validation_names_the_option():
    with pytest.raises(TypeError, match="cpu_tiles"):
        with tg.options(cpu_tiles=64):
            pass
    with pytest.raises(ValueError, match="cpu_tiles"):
        with tg.options(cpu_tiles=(4, 4096)):
            pass
    with tg.options(cpu_tiles=[32, 48]) as o:
        assert o.cpu_tiles == (32, 48)
    BM, BN, why = tiles.machine_tiles()
    assert tiles.choose(tg.Options(), False, full=True) == (2 * BM, BN, why + "; full blocks: twice the query rows")
    # pruning keeps its fixed tiles whatever is asked
    assert tiles.choose(tg.Options(cpu_tiles=(32, 48)), prune=True)[:2] == tiles.PRUNE_TILES


def test_environment_default_is_checked():
    """A malformed setting is ignored with a warning naming it (the machine's rule holds); the
    import does not fail."""
    code = "import tiga_numba; print(tiga_numba.Options().cpu_tiles)"
    r = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                       env={"TIGA_NUMBA_CPU_TILES": "256by256", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "TIGA_NUMBA_CPU_TILES" in r.stderr and "ignored" in r.stderr
    assert r.stdout.strip() == "None"


# 36 x 40: BN not a whole number of the own product's column blocks (16 or 64): packed tiles stay
# rows, not panels, and the strips of the forward cover whole tiles
@pytest.mark.parametrize("choice", [None, (48, 80), (36, 40)], ids=["machine-rule", "48x80", "36x40"])
def test_every_tile_choice_matches_the_oracle(choice):
    H, Hkv, D = 2, 1, 16
    for name, g in RELATIONS.items():
        q = RNG.standard_normal((g.num_dst, H, D), dtype=np.float32)
        k = RNG.standard_normal((g.num_src, Hkv, D), dtype=np.float32)
        v = RNG.standard_normal((g.num_src, Hkv, 8), dtype=np.float32)
        dout = RNG.standard_normal((g.num_dst, H, 8), dtype=np.float32)
        mask = g.to_scipy().toarray() != 0
        want, _, wl, wdq, wdk, wdv = attention_oracle(q, k, v, mask, dout=dout)
        with tg.options(cpu_tiles=choice):
            plan = tg.make_plan(q, k, v, g)
            out, st = tg.attention(q, k, v, g, return_stats=True)
            grads = tg.attention_backward(dout, q, k, v, out, st, g)
        BM, BN, _ = plan.tiles  # decided before the call, and what the kernels then ran with
        width = None if g._blocks.standard else g._blocks.band_width
        assert plan.tiles == tiles.choose(plan.options, False, full=g.kind == "dense", band_width=width,
                                          forward=True)
        assert plan.options.cpu_tiles == choice
        assert st.plan.run_info["tiles"].startswith(f"BM={BM} BN={BN} ("), st.plan.run_info["tiles"]
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5, err_msg=name)
        np.testing.assert_allclose(st.l, wl, rtol=2e-5, err_msg=name)
        for gname, got, ref in zip("qkv", grads, (wdq, wdk, wdv)):
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4, err_msg=f"{name} d{gname}")


def test_explain_shows_the_tiles_and_their_reason():
    g = RELATIONS["triangular"]
    q = RNG.standard_normal((N, 1, 8), dtype=np.float32)
    with tg.options(cpu_tiles=None):
        out, st = tg.attention(q, q, q, g, return_stats=True)
    text = st.plan.explain()
    BM, BN, why = tiles.machine_tiles()
    assert f"BM={BM} BN={BN} ({why})" in text, text


def test_backward_bits_do_not_depend_on_the_thread_count_with_the_rule_tiles():
    import numba
    g = RELATIONS["segments"]
    q = RNG.standard_normal((N, 2, 16), dtype=np.float32)
    dout = RNG.standard_normal((N, 2, 16), dtype=np.float32)
    with tg.options(cpu_tiles=None):
        out, st = tg.attention(q, q, q, g, return_stats=True)
        old = numba.get_num_threads()
        runs = []
        try:
            for threads in sorted({1, old}):
                numba.set_num_threads(threads)
                runs.append(tg.attention_backward(dout, q, q, q, out, st, g))
        finally:
            numba.set_num_threads(old)
    for a, b in zip(runs[0], runs[-1]):
        assert np.array_equal(a, b)


def test_narrow_bands_get_span_tiles():
    """a band no wider than twice the rule's BN runs its forward on one key tile per query tile
    (BAND_SIDE rows x 2 BN + BAND_SIDE keys: most of a large square tile would lie outside the
    band) and its backward on one query tile per key tile (the transposed shape); a wide band,
    or an explicit cpu_tiles, keeps the rule's / the caller's."""
    BM, BN, _ = tiles.machine_tiles()
    span = 2 * BN + tiles.BAND_SIDE
    q = RNG.standard_normal((N, 1, 8), dtype=np.float32)
    band = tg.Graph.band(N, left=BN - 1, right=0)
    with tg.options(cpu_tiles=None):
        narrow = tg.make_plan(q, q, q, band)
        wide = tg.make_plan(q, q, q, tg.Graph.band(N, left=2 * BN + 5, right=0))
        window = tg.make_plan(q, q, q, tg.Graph.cu_seqlens(np.array([0, 250, N]), window=(31, 0)))
        out, st = tg.attention(q, q, q, band, return_stats=True)
        tg.attention_backward(q, q, q, q, out, st, band)
        backward_text = tg.explain()
    assert narrow.tiles[:2] == (tiles.BAND_SIDE, span) and "spanning each query tile's band" in narrow.tiles[2]
    assert window.tiles[:2] == (tiles.BAND_SIDE, span)
    assert wide.tiles[:2] == (BM, BN)
    assert (f"BM={span} BN={tiles.BAND_SIDE} (band of {BN} keys <= 2 x BN={BN}: one query tile spanning each "
            "key tile's band)") in backward_text, backward_text
    with tg.options(cpu_tiles=(48, 80)):
        assert tg.make_plan(q, q, q, tg.Graph.band(N, left=BN - 1, right=0)).tiles[:2] == (48, 80)


@pytest.mark.parametrize("left,right", [(None, 0), (37, 5), (0, 0)], ids=["widest", "two-sided", "diagonal"])
def test_span_tiles_match_the_oracle(left, right):
    """the span tiles of narrow bands (read in place from each tile's first band key / row, ends
    clipped to the band, one gemm per product with finite operands) against float64, GQA, tails;
    None: the widest narrow band of this machine's rule"""
    if left is None:
        left = 2 * tiles.machine_tiles()[1] - 1
    g = tg.Graph.band(N - 3, left=left, right=right)
    q = RNG.standard_normal((g.num_dst, 4, 16), dtype=np.float32)
    k = RNG.standard_normal((g.num_src, 2, 16), dtype=np.float32)
    v = RNG.standard_normal((g.num_src, 2, 8), dtype=np.float32)
    dout = RNG.standard_normal((g.num_dst, 4, 8), dtype=np.float32)
    want, _, wl, wdq, wdk, wdv = attention_oracle(q, k, v, g.to_scipy().toarray() != 0, dout=dout)
    with tg.options(cpu_tiles=None):
        out, st = tg.attention(q, k, v, g, return_stats=True)
        assert "spanning each query tile's band" in st.plan.run_info["tiles"]
        grads = tg.attention_backward(dout, q, k, v, out, st, g)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(st.l, wl, rtol=2e-5)
    for gname, got, ref in zip("qkv", grads, (wdq, wdk, wdv)):
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4, err_msg=f"d{gname}")
