"""Tile pruning on the CPU block kernels.

The rule (docs/cpu_backend.md): for each (query tile of BM rows, key tile of BN columns),
per head, the scores are computed, then the tile is admitted only if
max(tile scores) >= m_run_block + ln(rho), m_run_block the running max over the whole query
tile.  The rule-applying oracle is ``tiga_numba.reference.pruned_attention`` with the CPU tile
sizes.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba import functional, reference
from tiga_numba.cpu import api
from tiga_numba.cpu.tiles import PRUNE_TILES
from tiga_numba.graph import Graph

BM, BN = PRUNE_TILES  # the pruning rule works on fixed tiles


def _random(g, dt=np.float32, H=2, Hkv=1, D=16, Dv=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((g.num_dst, H, D)).astype(dt),
            rng.standard_normal((g.num_src, Hkv, D)).astype(dt),
            rng.standard_normal((g.num_src, Hkv, Dv)).astype(dt))


def _local(g, first_keys, H=2, D=16, Dv=8, seed=0):
    """Queries ~ 10 e0; keys whose source index is in `first_keys` ~ e0 (score ~ 10), every
    other key ~ 0.4 e0 (score ~ 4).  With scale 1 and rho = 1e-2 (ln rho = -4.6) a tile of
    only 'other' keys has max ~ 4 < 10 - 4.6 and is provably rejected once a tile holding a
    first key has been admitted; its exp(-6) weights are large enough that dropping them
    changes the output visibly."""
    rng = np.random.default_rng(seed)
    e0 = np.zeros(D)
    e0[0] = 1.0
    q = 10 * e0 + 0.02 * rng.standard_normal((g.num_dst, H, D))
    k = 0.4 * e0 + 0.02 * rng.standard_normal((g.num_src, 1, D))
    k[first_keys, :, 0] = 1.0
    v = rng.standard_normal((g.num_src, 1, Dv))
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def _max_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max())


@pytest.mark.parametrize("g", [Graph.dense(200, 150), Graph.triangular(200),
                               Graph.cu_seqlens(np.array([0, 1, 1, 90, 230]), causal=True)],
                         ids=["dense", "triangular", "segments"])
def test_tiny_rho_equals_exact(g):
    q, k, v = _random(g, seed=1)
    exact, se = tg.attention(q, k, v, g, return_stats=True)
    pruned, sp = tg.attention(q, k, v, g, block_prune_threshold=1e-30, return_stats=True)
    info = functional.last_plan().run_info
    assert info["pruned_tiles"] == 0 and info["total_tiles"] > 0
    np.testing.assert_allclose(pruned, exact, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sp.l, se.l, rtol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "triangular", "segments"])
def test_provably_low_tiles_are_skipped(kind):
    if kind == "dense":
        g = Graph.dense(3 * BN + 5, 2 * BM + 3)
        first = [0, 1, 2]  # only the first key tile is strong
    elif kind == "triangular":
        g = Graph.triangular(3 * BM + 7)
        first = [0, 1]  # every query row sees keys 0, 1 (j <= i)
    else:
        g = Graph.cu_seqlens(np.array([0, 2 * BM + 9, 2 * BM + 10, 4 * BM + 30]), causal=True)
        first = [0, 2 * BM + 9, 2 * BM + 10]
    q, k, v = _local(g, first)
    rho = 1e-2
    out, stats = tg.attention(q, k, v, g, scale=1.0, block_prune_threshold=rho,
                              return_stats=True)
    info = functional.last_plan().run_info
    want, wm, wl, (pruned, total) = reference.pruned_attention(
        q, k, v, g, rho=rho, block_m=BM, block_n=BN, scale=1.0, return_stats=True)
    assert pruned > 0, "the construction must make some tiles provably prunable"
    assert (info["pruned_tiles"], info["total_tiles"]) == (pruned, total)
    assert _max_err(out, want) < 1e-5
    np.testing.assert_allclose(stats.l, wl, rtol=1e-5)
    # the test can fail: the exact answer differs from the pruned one by much more
    exact = reference.attention(q, k, v, g, scale=1.0)
    assert _max_err(want, exact) > 1e-3
    assert "tiles pruned" in functional.last_plan().explain()


def test_random_inputs_match_rule_oracle():
    """Random scores, rho = 0.5: some tiles fall near the threshold, where the float32 kernel
    and the float64 oracle may decide differently; the output is compared whenever both
    pruned the same number of tiles (which is the case for this seed)."""
    g = Graph.dense(4 * BN, 2 * BM)
    q, k, v = _random(g, seed=3, D=16)
    q *= 3  # spread the scores so that some tiles fall below max + ln(0.5)
    out = tg.attention(q, k, v, g, block_prune_threshold=0.5)
    info = functional.last_plan().run_info
    want, _, _, (pruned, total) = reference.pruned_attention(
        q, k, v, g, rho=0.5, block_m=BM, block_n=BN, return_stats=True)
    assert info["total_tiles"] == total and pruned > 0
    if info["pruned_tiles"] == pruned:
        assert _max_err(out, want) < 1e-4


def test_pruning_fails_closed():
    g = Graph.from_csr(np.array([0, 2, 3]), np.array([0, 1, 1], np.int32), num_src=2)
    q, k, v = _random(g)
    with pytest.raises(NotImplementedError):
        tg.attention(q, k, v, g, block_prune_threshold=0.1)
    gt = Graph.triangular(10)
    q, k, v = _random(gt)
    out, stats = tg.attention(q, k, v, gt, block_prune_threshold=0.1, return_stats=True)
    with pytest.raises(NotImplementedError):
        tg.attention_backward(np.ones_like(out), q, k, v, out, stats, gt)
    # the backend refuses on its own too, should a pruned plan ever reach it
    plan = SimpleNamespace(scale=0.25, prune_threshold=0.1, run_info={})
    with pytest.raises(NotImplementedError):
        api.backward(plan, out, q, k, v, out, stats.m, stats.l, gt.realize("cpu"), None)


@pytest.mark.parametrize("rho", [0.0, -1.0, 1.5, float("nan")])
def test_rho_out_of_range(rho):
    g = Graph.triangular(4)
    q, k, v = _random(g)
    with pytest.raises(ValueError):
        tg.attention(q, k, v, g, block_prune_threshold=rho)


def test_exact_request_is_never_pruned():
    g = Graph.triangular(3 * BM)
    q, k, v = _local(g, [0, 1])
    out = tg.attention(q, k, v, g, scale=1.0)
    info = functional.last_plan().run_info
    assert "pruned_tiles" not in info or info["pruned_tiles"] == 0
    assert _max_err(out, reference.attention(q, k, v, g, scale=1.0)) < 1e-5
