"""Tensor-core kernels on the numpy warp emulator (no GPU): every generated variant family
(forward, dQ, dK/dV, Delta) against a float64 oracle on fresh random inputs, over dense
rectangular, causal, segmented (length-0/1 blocks), tails and GQA, for float16, bfloat16 and
float32 (3xTF32, tf32 rounding emulated bit-exactly); plus a deliberately broken fragment layout
and a plain-TF32 (one pass) kernel that must both fail, and PTX compile checks when numba-cuda
is installed."""
import numpy as np
import pytest

from conftest import set_run_option

import tiga_numba  # noqa: E402,F401  (first: shields tiga_numba.cuda from numba-cuda's import redirector)

from tiga_numba.cuda.tc import admission, api, build, device, tuning  # noqa: E402
from tiga_numba.cuda.tc import emulator as E  # noqa: E402
from tiga_numba.cuda.tc import generator as G  # noqa: E402
from tiga_numba.cuda.tc.generator import shared as GS  # noqa: E402
from tiga_numba.cuda.tc.generator import source as GSrc  # noqa: E402
from tiga_numba.cuda.tc.generator import variant as GV  # noqa: E402
from tiga_numba.cuda.tc.generator import wgmma as GW  # noqa: E402
from tiga_numba.cuda.tc import schedule as S  # noqa: E402



def patch_generator(monkeypatch, name, value):
    """Replace `name` in every generator module that holds it (each module imports the functions it
    calls by name, so a stand-in must reach all of them)."""
    import importlib
    import pkgutil
    found = False
    for info in pkgutil.iter_modules(G.__path__):
        mod = importlib.import_module(f"{G.__name__}.{info.name}")
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, value)
            found = True
    assert found, name

def oracle(q, k, v, do, dst, src, causal, scale):
    """float64 reference: out, m, l and the gradients (dq, dk, dv)."""
    nd, H, D = q.shape
    ns, Hkv, Dv = v.shape
    g = H // Hkv
    out = np.zeros((nd, H, Dv))
    m = np.full((nd, H), -np.inf)
    l = np.zeros((nd, H))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(len(causal)):
        i0, i1, j0, j1 = dst[b], dst[b + 1], src[b], src[b + 1]
        if i1 == i0 or j1 == j0:
            continue
        for h in range(H):
            qq = q[i0:i1, h].astype(np.float64)
            kk = k[j0:j1, h // g].astype(np.float64)
            vv = v[j0:j1, h // g].astype(np.float64)
            s = qq @ kk.T * scale
            if causal[b]:
                s = np.where(np.tril(np.ones_like(s)) > 0, s, -np.inf)
            mm = s.max(1)
            p = np.exp(s - mm[:, None])
            ll = p.sum(1)
            p /= ll[:, None]
            o = p @ vv
            out[i0:i1, h], m[i0:i1, h], l[i0:i1, h] = o, mm, ll
            dO = do[i0:i1, h].astype(np.float64)
            dv[j0:j1, h // g] += p.T @ dO
            ds = p * (dO @ vv.T - (dO * o).sum(1)[:, None])
            dq[i0:i1, h] = ds @ kk * scale
            dk[j0:j1, h // g] += ds.T @ qq * scale
    return out, m, l, dq, dk, dv


def rounded(x, dtype):
    return E.from_storage(E.to_storage(x, dtype), dtype)


def rel(a, b):
    nb = np.linalg.norm(b)
    return np.linalg.norm(a - b) / nb if nb > 0 else np.abs(a).max()


RELATIONS = {
    # name: (dst_offsets, src_offsets, causal)
    "dense_rect_tail": ([0, 70], [0, 45], [0]),
    "causal_tail": ([0, 131], [0, 131], [1]),
    "segments": ([0, 1, 1, 40, 97, 98], [0, 1, 1, 40, 97, 98], [1, 1, 1, 0, 1]),
    "empty_keys": ([0, 5, 5], [0, 0, 9], [0, 0]),
}
#: relative L2 error bounds; float32 is held to fp32-class accuracy (3xTF32 measures ~3e-7 here,
#: plain TF32 ~5e-4, see test_plain_tf32_is_caught)
TOL = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-5}


def _inputs(rng, nd, ns, H, Hkv, D, dtype):
    mk = lambda s, f=1.0: rounded((rng.standard_normal(s) * f).astype(np.float32), dtype)  # noqa: E731
    return mk((nd, H, D), 1.5), mk((ns, Hkv, D)), mk((ns, Hkv, D)), mk((nd, H, D))


@pytest.mark.parametrize("D,H,Hkv,dtype,shape", [
    (64, 2, 1, "float16", dict(NW=4, MT=2, BN=64)),
    (64, 1, 1, "bfloat16", dict(NW=4, MT=1, BN=64)),
    (128, 2, 2, "float16", dict(NW=4, MT=1, BN=32)),
    (64, 3, 3, "float16", dict(NW=8, MT=1, BN=32)),
    (128, 2, 1, "float16", dict(NW=4, MT=2, BN=16, a_smem=True)),
    (128, 1, 1, "float16", dict(NW=4, MT=2, BN=32, a_smem=True)),   # shipped D=128 (dynamic smem)
    (64, 2, 1, "float32", dict(NW=4, MT=1, BN=64, a_smem=True)),
    (64, 1, 1, "float32", dict(NW=8, MT=1, BN=64)),                  # shipped: Q in registers (tf32 halves)
    (128, 2, 2, "float32", dict(NW=8, MT=1, BN=32, a_smem=True)),    # shipped; 4-row cp.async passes
])
@pytest.mark.parametrize("relname", list(RELATIONS))
def test_forward_emulated(D, H, Hkv, dtype, shape, relname):
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(hash((D, H, relname)) % 2 ** 32)
    q, k, v, _ = _inputs(rng, dst[-1], src[-1], H, Hkv, D, dtype)
    vr = G.Variant("fwd", D, D, dtype=dtype, **shape)
    o, m, l = E.forward(vr, q, k, v, dst, src, causal.astype(np.uint8), D ** -0.5)
    ro, rm, rl, *_ = oracle(q, k, v, q, dst, src, causal, D ** -0.5)
    assert np.isfinite(o).all()
    assert rel(o, ro) < TOL[dtype]
    live = np.isfinite(rm)
    np.testing.assert_allclose(m[live], rm[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l[live], rl[live], rtol=1e-4)
    assert (m[~live] == -np.inf).all() and (l[~live] == 0).all() and (o[~live] == 0).all()


@pytest.mark.parametrize("D,H,Hkv,dtype,BNq,BNk,a_smem,NW", [(64, 2, 1, "float16", 64, 64, False, 4),
                                                             (128, 1, 1, "bfloat16", 32, 32, False, 4),
                                                             (128, 2, 1, "float16", 16, 16, True, 4),
                                                             (128, 2, 2, "float16", 64, 32, True, 4),  # shipped D=128
                                                             (64, 2, 1, "float32", 32, 32, True, 4),   # shipped fp32
                                                             (128, 2, 1, "float32", 32, 16, True, 8)])  # shipped fp32
@pytest.mark.parametrize("relname", ["dense_rect_tail", "segments", "empty_keys"])
def test_backward_emulated(D, H, Hkv, dtype, BNq, BNk, a_smem, NW, relname):
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(7 + D + len(relname))
    q, k, v, do = _inputs(rng, dst[-1], src[-1], H, Hkv, D, dtype)
    scale = D ** -0.5
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, scale)
    vq = G.Variant("dq", D, D, dtype=dtype, NW=NW, MT=1, BN=BNq, a_smem=a_smem)
    vk = G.Variant("dkdv", D, D, dtype=dtype, NW=NW, MT=1, BN=BNk, a_smem=a_smem)
    out = rounded(ro.astype(np.float32), dtype)
    dq, dk, dv = E.backward(vq, vk, do, q, k, v, out, rm.astype(np.float32), rl.astype(np.float32),
                            dst, src, causal.astype(np.uint8), scale)
    tol = 3 * TOL[dtype]
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert np.isfinite(got).all()
        assert rel(got, want) < tol


#: tuning.FUSED_DKDV's shapes and the other warp splits of the dQ product
FUSED = [(64, 2, 1, "float16", dict(NW=4, MT=1, BN=64)),                       # K in registers and shared
         (128, 2, 1, "float16", dict(NW=4, MT=1, BN=32, a_smem=True)),         # 2 x 2 warp grid for dQ
         (64, 3, 3, "bfloat16", dict(NW=4, MT=1, BN=64, a_smem=True)),
         (64, 2, 1, "float32", dict(NW=4, MT=1, BN=32, a_smem=True)),
         (128, 2, 1, "float32", dict(NW=4, MT=1, BN=32, a_smem=True)),
         (128, 1, 1, "float32", dict(NW=4, MT=1, BN=16, a_smem=True))]        # 1 x 4 warp grid


@pytest.mark.parametrize("D,H,Hkv,dtype,shape", FUSED)
@pytest.mark.parametrize("relname", list(RELATIONS))
def test_fused_backward_emulated(D, H, Hkv, dtype, shape, relname):
    """one kernel computes dK, dV and dQ (dS stored transposed to shared memory, dQ = dS K, blocks
    added in key-tile order to a poisoned float32 accumulator; the emulator raises if a CTA's turn
    comes out of order). dQ rows of blocks without keys are zero, the rest is written by the kernel."""
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(11 + D + len(relname))
    q, k, v, do = _inputs(rng, dst[-1], src[-1], H, Hkv, D, dtype)
    scale = D ** -0.5
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, scale)
    vk = G.Variant("dkdv", D, D, dtype=dtype, fuse_dq=True, **shape)
    out = rounded(ro.astype(np.float32), dtype)
    dq, dk, dv = E.backward(None, vk, do, q, k, v, out, rm.astype(np.float32), rl.astype(np.float32),
                            dst, src, causal.astype(np.uint8), scale)
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert np.isfinite(got).all()
        assert rel(got, want) < 3 * TOL[dtype]


@pytest.mark.parametrize("D,dtype,shape", [(64, "float16", dict(NW=4, MT=1, BN=64, a_smem=True)),
                                           (64, "float32", dict(NW=4, MT=1, BN=32, a_smem=True))])
@pytest.mark.parametrize("relname", ["causal_tail", "segments", "empty_keys"])
def test_fused_atomic_dq_emulated(D, dtype, shape, relname):
    """Variant.dq_atomic (the non-deterministic experiment: red.global.add into a zeroed float32
    accumulator, then the convert pass) computes the same gradients."""
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(3 + D + len(relname))
    q, k, v, do = _inputs(rng, dst[-1], src[-1], 2, 1, D, dtype)
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, D ** -0.5)
    vk = G.Variant("dkdv", D, D, dtype=dtype, fuse_dq=True, dq_atomic=True, **shape)
    got = E.backward(None, vk, do, q, k, v, rounded(ro.astype(np.float32), dtype), rm.astype(np.float32),
                     rl.astype(np.float32), dst, src, causal.astype(np.uint8), D ** -0.5)
    for g, want in zip(got, (rdq, rdk, rdv)):
        assert np.isfinite(g).all() and rel(g, want) < 3 * TOL[dtype]


def test_atomic_opt_in_routing(monkeypatch):
    """TIGA_NUMBA_DETERMINISTIC=0 selects the float-atomic fused kernel only where tuning.ATOMIC_DQ
    lists it (float32); everything else keeps the deterministic kernels; prebuild covers it."""
    set_run_option(monkeypatch, "deterministic", "1")
    assert tuning.deterministic()
    set_run_option(monkeypatch, "deterministic", "0")
    assert not tuning.deterministic()
    for dt in tuning.TC_DTYPES:
        for D in (64, 128):
            vq, vk = tuning.backward_variants(D, D, dt, tuning.deterministic())
            assert (vq is None and vk.dq_atomic) == ((dt, D) in tuning.ATOMIC_DQ)
            assert tuning.backward_variants(D, D, dt, True)[1].dq_atomic is False
    assert {(D, dt) for kind, D, dt in build.shipped_kernels() if kind == "dkdv_atomic"} == \
        {(D, dt) for dt, D in tuning.ATOMIC_DQ}


def test_fused_turn_order_is_enforced(monkeypatch):
    """The deadlock-freedom argument needs every key tile of a block to come after the lower ranks
    in launch order. A schedule that breaks it must fail (the emulator runs CTAs in launch order,
    so a CTA meeting a counter that is not its turn raises), not silently reorder the sums."""
    real = S.key_tiles
    monkeypatch.setattr(S, "key_tiles", lambda *a: np.ascontiguousarray(real(*a)[::-1]))
    dst, src, causal = (np.array(x) for x in RELATIONS["causal_tail"])   # 3 key tiles of 64
    q, k, v, do = _inputs(np.random.default_rng(0), dst[-1], src[-1], 1, 1, 64, "float16")
    ro, rm, rl, *_ = oracle(q, k, v, do, dst, src, causal, 0.125)
    vk = G.Variant("dkdv", 64, 64, NW=4, MT=1, BN=64, fuse_dq=True)
    with pytest.raises(RuntimeError, match="turn order"):
        E.backward(None, vk, do, q, k, v, rounded(ro.astype(np.float32), "float16"), rm.astype(np.float32),
                   rl.astype(np.float32), dst, src, causal.astype(np.uint8), 0.125)


def test_key_tiles_keep_rank_order_within_each_block():
    """schedule.key_tiles reorders tiles by work (long causal tiles first); within a block the key
    tiles must stay in increasing order (the fused backward's turn order), on random segment mixes."""
    rng = np.random.default_rng()
    for _ in range(50):
        n = rng.integers(1, 12)
        off = np.concatenate([[0], np.cumsum(rng.integers(0, 300, n))])
        causal = rng.integers(0, 2, n)
        for BM in (64, 128):
            tab = S.key_tiles(off, off, causal, BM)
            for c0 in np.unique(tab[:, 2]):
                diags = tab[tab[:, 2] == c0, 4]
                assert np.all(np.diff(diags) > 0), (off, causal, BM)


def test_fused_warp_split_rules():
    """the dQ product splits BN x D over the warps in m16 row tiles and whole 128-byte column groups;
    what cannot be split that way is refused with a clear message, not mis-tiled."""
    assert G.Variant("dkdv", 128, 128, NW=4, BN=32, fuse_dq=True).dq_warps() == (2, 2, 1, 4)
    assert G.Variant("dkdv", 128, 128, dtype="float32", NW=8, BN=32, a_smem=True, fuse_dq=True).dq_warps() == (2, 4, 1, 2)
    with pytest.raises(ValueError, match="cannot split"):
        G.Variant("dkdv", 64, 64, NW=8, BN=64, fuse_dq=True).check()
    with pytest.raises(ValueError, match="dK/dV kernel option"):
        G.Variant("dq", 64, 64, fuse_dq=True).check()


def test_fused_ptx_compiles_for_sm90():
    """the fused kernel lowers for sm_90: 5 products of mma (S, dV, dP, dK, dQ), the turn counter
    as ld.acquire / st.release at GPU scope, no float atomics, no local arrays."""
    pytest.importorskip("numba_cuda")
    import numba
    from numba import cuda

    v = G.Variant("dkdv", 64, 64, NW=4, MT=1, BN=64, fuse_dq=True)
    env = build._env("float16")
    exec(compile(G.gen_source(v), "<k>", "exec"), env)
    ni, nf = build.signature(v)
    ptx, _ = cuda.compile_ptx(env["kernel"], numba.void(*((numba.int64,) * ni + (numba.float32,) * nf)),
                              cc=(9, 0), fastmath=True)
    per_product = v.MT * (v.BN // 8) * (64 // 16)   # per warp: m16 tiles x n8 tiles x k16 steps (all five equal)
    assert ptx.count("mma.sync.aligned.m16n8k16") == 5 * per_product
    assert "ld.acquire.gpu.global.u32" in ptx and "st.release.gpu.global.u32" in ptx
    assert "st.shared.v2.f32" in ptx and "ld.shared.v4.f32" in ptx and ".local" not in ptx
    import re
    assert not re.search(r"\b(atom|red)\.", ptx)


def test_broken_swizzle_is_caught(monkeypatch):
    """A wrong fragment layout must fail the emulator check (the test can fail)."""
    real = GS.thread_geometry

    def broken(e, v):
        real(e, v)
        e("xa128_0 = xa128_1")   # k-step 0 would read k-step 1's chunk
    patch_generator(monkeypatch, "thread_geometry", broken)
    dst, src, causal = (np.array(x) for x in RELATIONS["dense_rect_tail"])
    rng = np.random.default_rng(3)
    q, k, v, _ = _inputs(rng, dst[-1], src[-1], 1, 1, 64, "float16")
    vr = G.Variant("fwd", 64, 64, NW=4, MT=1, BN=64)
    o, _, _ = E.forward(vr, q, k, v, dst, src, causal.astype(np.uint8), 0.125)
    ro, *_ = oracle(q, k, v, q, dst, src, causal, 0.125)
    assert rel(o, ro) > 1e-2


def _fp32_case(relname, D=64):
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng()
    q, k, v, do = _inputs(rng, dst[-1], src[-1], 2, 1, D, "float32")
    return q, k, v, do, dst, src, causal


def test_plain_tf32_is_caught(monkeypatch):
    """One tf32 pass (big * big, i.e. plain TF32) must fail the float32 tolerances of the forward
    and the backward: the tests above really check 3xTF32 accuracy."""
    patch_generator(monkeypatch, "TF32_PASSES", (("big", "big"),))
    q, k, v, do, dst, src, causal = _fp32_case("causal_tail")
    scale = 64 ** -0.5
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, scale)
    vr = G.Variant("fwd", 64, 64, dtype="float32", NW=4, MT=1, BN=64, a_smem=True)
    o, _, _ = E.forward(vr, q, k, v, dst, src, causal.astype(np.uint8), scale)
    assert rel(o, ro) > 10 * TOL["float32"]
    vq = G.Variant("dq", 64, 64, dtype="float32", NW=4, MT=1, BN=64, a_smem=True)
    vk = G.Variant("dkdv", 64, 64, dtype="float32", NW=4, MT=1, BN=64, a_smem=True)
    dq, dk, dv = E.backward(vq, vk, do, q, k, v, ro.astype(np.float32), rm.astype(np.float32),
                            rl.astype(np.float32), dst, src, causal.astype(np.uint8), scale)
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel(got, want) > 3 * 3 * TOL["float32"]


@pytest.mark.parametrize("pb_pairs,ok", [(2, True), (None, False)])
def test_fp32_long_rows_accumulate_per_block(monkeypatch, pb_pairs, ok):
    """2048 keys a row: with O accumulated per block (generator.PB_PAIRS) the forward stays
    fp32-class under the emulator's truncating accumulation; feeding O back into the mma across
    all 32 blocks (PB_PAIRS = None) drifts past the float32 tolerance, as it did on the H200."""
    patch_generator(monkeypatch, "PB_PAIRS", pb_pairs)
    dst, src, causal = np.array([0, 16]), np.array([0, 2048]), np.array([0])
    rng = np.random.default_rng()
    q, k, v, _ = _inputs(rng, 16, 2048, 1, 1, 64, "float32")
    ro, *_ = oracle(q, k, v, q, dst, src, causal, 0.125)
    vr = G.Variant("fwd", 64, 64, dtype="float32", NW=4, MT=1, BN=64, a_smem=True)
    o, _, _ = E.forward(vr, q, k, v, dst, src, causal.astype(np.uint8), 0.125)
    assert (rel(o, ro) < TOL["float32"] / 2) == ok


def test_tf32_split_is_exact_to_fp32():
    """cvt.rna emulation: big has a 10-bit mantissa, big + small equals x to ~2^-22, ties round
    away from zero."""
    rng = np.random.default_rng()
    x = (rng.standard_normal(1000) * 10.0 ** rng.integers(-5, 5, 1000)).astype(np.float32)
    w = E.Warps(32, 16, E.Memory(), "float32")   # one warp: tf32x2 works on 32 lanes at a time
    for chunk in np.split(x[:992], 31):
        big, small = w.tf32x2(chunk)
        assert not (big & 0x1FFF).any() and not (small & 0x1FFF).any()
        back = big.view(np.float32).astype(np.float64) + small.view(np.float32).astype(np.float64)
        assert np.all(np.abs(back - chunk) <= 2.0 ** -21 * np.abs(chunk))
    tie = np.array([1.0 + 2.0 ** -11], np.float32).view(np.uint32)   # exactly half a tf32 ulp
    assert E.tf32_rna(tie).view(np.float32)[0] == np.float32(1.0 + 2.0 ** -10)


def test_out_of_bounds_is_caught():
    """The emulator's memory check raises on an access outside every buffer."""
    mem = E.Memory()
    base = mem.put(np.zeros(16, np.uint8))
    with pytest.raises(IndexError):
        mem.check(base + 8, 16)


def test_schedule_tiles():
    dst = np.array([0, 0, 1, 130, 130])
    causal = np.array([1, 1, 1, 0], np.uint8)
    t = S.query_tiles(dst, dst, causal, 64)
    # blocks of 0, 1, 129 rows: 0 + 1 + 3 tiles; rows cover each block exactly once
    assert len(t) == 4
    covered = sorted((r0, r0 + min(n, 64)) for r0, n, *_ in t)
    assert covered == [(0, 1), (1, 65), (65, 129), (129, 130)]
    # ordered by decreasing work: the columns between the first row's lower and last row's upper limit
    rows, cols, lo, hi = (t[:, i].astype(np.int64) for i in (1, 3, 6, 7))
    work = np.minimum(cols, hi + np.minimum(rows, 64)) - np.clip(lo, 0, None)
    assert np.all(np.diff(work) <= 0), work
    kt = S.key_tiles(np.array([0, 3]), np.array([0, 0]), np.array([0], np.uint8), 64)
    assert len(kt) == 0
    vis, tot = S.tile_counts(np.array([0, 256]), np.array([0, 256]), np.array([1], np.uint8), 128, 64)
    assert tot == 8 and vis == 2 + 4


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_generated_source_is_plain_python(kind):
    src = G.gen_source(G.Variant(kind, 64, 64, NW=4, MT=1, BN=64))
    compile(src, "<gen>", "exec")
    assert "mma16816" in src and "def kernel(" in src


def test_shipped_tuning_is_valid():
    """every default shape (mma.sync, wgmma, 3xTF32; pruned forwards too) fits the shared-memory
    limit and its generator runs."""
    import dataclasses

    for dt in ("float16", "bfloat16", "float32"):
        for wg in (False, True):
            for (kind, D) in tuning.tuning_table(dt, wgmma=wg):
                v = tuning.variant(kind, D, D, dt, wgmma=wg)
                for x in ((v, dataclasses.replace(v, prune=True)) if kind == "fwd" else (v,)):
                    assert x.check().smem_bytes() <= G.MAX_SMEM
                    compile(G.gen_source(x), "<gen>", "exec")


def test_ptx_compiles_for_sm90():
    pytest.importorskip("numba_cuda")
    import numba
    from numba import cuda

    v = G.Variant("fwd", 64, 64, NW=4, MT=1, BN=64)
    env = build._env("float16")
    exec(compile(G.gen_source(v), "<k>", "exec"), env)
    ni, nf = build._SIGS["fwd"]
    ptx, _ = cuda.compile_ptx(env["kernel"], numba.void(*((numba.int64,) * ni + (numba.float32,) * nf)),
                              cc=(9, 0), fastmath=True)
    assert ptx.count("mma.sync.aligned.m16n8k16") == 2 * 4 * 8 * 1
    assert "cp.async.cg.shared.global" in ptx and ".local" not in ptx


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_fp32_ptx_compiles_for_sm90(kind):
    """the float32 (3xTF32) kernels lower to PTX for sm_90: three tf32 mma per m16n8k8 product,
    the cvt.rna split, no local arrays. Narrow key blocks (BN = 16) keep NVVM's time small in CI;
    forward with Q in registers, dQ and dK/dV with shared-resident operands (both resident paths)."""
    pytest.importorskip("numba_cuda")
    import numba
    from numba import cuda

    v = G.Variant(kind, 64, 64, dtype="float32", NW=4, MT=1, BN=16, a_smem=kind != "fwd")
    env = build._env("float32")
    exec(compile(G.gen_source(v), "<k>", "exec"), env)
    ni, nf = build._SIGS[kind]
    ptx, _ = cuda.compile_ptx(env["kernel"], numba.void(*((numba.int64,) * ni + (numba.float32,) * nf)),
                              cc=(9, 0), fastmath=True)
    products = {"fwd": 2, "dq": 3, "dkdv": 4}[kind]   # S, PV | S, dP, dS K | S, P^T dO, dP, dS^T Q
    per_product = v.MT * (v.BN // 8) * (64 // 8)       # m16 x n8 tiles x k8 steps
    assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 3 * products * per_product
    assert "cvt.rna.tf32.f32" in ptx and "m16n8k16" not in ptx and ".local" not in ptx


def test_cubin_cache_builds_without_a_gpu_and_serves_later_calls(tmp_path, monkeypatch):
    """TensorCoreKernel.cubin(): compile_ptx + nvJitLink on a machine without a GPU, written under
    TIGA_NUMBA_CACHE_DIR/tc; a second kernel object for the same text reads the file (no NVVM),
    and a different text (another head dim) gets its own file."""
    pytest.importorskip("numba_cuda")
    pytest.importorskip("cuda.core")
    from numba import cuda

    monkeypatch.setenv("TIGA_NUMBA_CACHE_DIR", str(tmp_path))
    src = G.gen_delta("float16", 64)
    k = build.TensorCoreKernel("tc_delta_test", src, "float16", 12, 0)
    entry, data = k.cubin("sm_90")
    assert data[:4] == b"\x7fELF" and "tc_delta_test" in entry
    files = sorted(p.name for p in (tmp_path / "tc").iterdir() if p.name.endswith(".cubin"))
    assert len(files) == 1 and files[0].endswith("-sm_90.cubin")

    def no_compile(*a, **kw):
        raise AssertionError("cache hit expected: NVVM must not run")
    monkeypatch.setattr(cuda, "compile_ptx", no_compile)
    again = build.TensorCoreKernel("tc_delta_test", src, "float16", 12, 0)
    assert again.cubin("sm_90") == (entry, data)
    other = build.TensorCoreKernel("tc_delta_test", G.gen_delta("float16", 128), "float16", 12, 0)
    with pytest.raises(AssertionError, match="cache hit expected"):
        other.cubin("sm_90")

    # one record per kernel (entry name + cubin, one rename): nothing else is left beside it
    assert sorted(p.name for p in (tmp_path / "tc").iterdir() if not p.name.endswith(".py")) == files


def test_cubin_cache_off_writes_nothing(tmp_path, monkeypatch):
    pytest.importorskip("numba_cuda")
    pytest.importorskip("cuda.core")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TIGA_NUMBA_CACHE_DIR", "0")
    assert build._cache_dir() is None
    entry, data = build.TensorCoreKernel("tc_delta_off", G.gen_delta("float16", 64), "float16", 12, 0).cubin("sm_90")
    assert data[:4] == b"\x7fELF" and entry
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="arch"):
        build.TensorCoreKernel("tc_delta_off", G.gen_delta("float16", 64), "float16", 12, 0).cubin("90")


def test_shipped_kernel_list_covers_every_routed_variant():
    shipped = set(build.shipped_kernels())
    for dt in tuning.TC_DTYPES:
        for D in tuning.head_dims(dt, False):
            vq, vk = tuning.backward_variants(D, D, dt)   # the kernels forward() / backward() launch
            routed = ["fwd", "dkdv", "delta"] + (["dq"] if vq is not None else [])
            for kind in routed:
                assert (kind, D, dt) in shipped
            assert (vq is None) == vk.fuse_dq
        for D in tuning.head_dims(dt, True):   # sm_90a
            assert all((k, D, dt) in shipped for k in ("wg:fwd", "wg:dq", "wg:dkdv", "delta"))
            fwd = tuning.variant("fwd", D, D, dt, wgmma=True)
            if tuning.narrow(fwd, 1) is not fwd:   # the narrow-band forward a window call launches
                assert ("wg:fwd@narrow", D, dt) in shipped


class _FakeDev:
    """stands in for a device array: only what supports() and _operand() read."""

    def __init__(self, shape, dtype="float16", strides=None, ptr=1 << 20):
        self.shape, self.ndim, self.dtype = shape, len(shape), np.dtype(dtype)
        self.__cuda_array_interface__ = dict(data=(ptr, False), shape=shape, strides=strides,
                                             typestr=self.dtype.str, version=3)


def test_supports_rules_without_gpu(monkeypatch):
    import types

    monkeypatch.setattr(admission, "_device_can_run", lambda D, Dv, dt, op="forward": True)   # no device here
    from tiga_numba.graph import BlockRelation
    rel_ = BlockRelation(np.array([0, 10]), np.array([0, 10]), np.array([1], np.uint8), 10, 10)
    plan = types.SimpleNamespace(scale=0.125, prune_threshold=None, score="dot", run_info={})
    q, kv = _FakeDev((10, 4, 64)), _FakeDev((10, 2, 64))
    assert api.supports(plan, q, kv, kv, rel_)
    assert api.supports(plan, _FakeDev((10, 4, 128)), _FakeDev((10, 1, 128)), _FakeDev((10, 1, 128)), rel_)
    assert not api.supports(plan, _FakeDev((10, 4, 96)), kv, kv, rel_)                   # D
    assert not api.supports(plan, q, kv, _FakeDev((10, 2, 128)), rel_)                   # Dv != D
    assert not api.supports(plan, q, _FakeDev((10, 3, 64)), _FakeDev((10, 3, 64)), rel_)  # H % Hkv
    assert not api.supports(plan, _FakeDev((10, 4, 64), "float32"), kv, kv, rel_)         # mixed dtypes
    f32 = [_FakeDev(x.shape, "float32") for x in (q, kv, kv)]
    assert api.supports(plan, *f32, rel_)                                                # 3xTF32
    set_run_option(monkeypatch, "fp32_tensor_cores", "0")                             # user opt-out
    assert not api.supports(plan, *f32, rel_) and api.supports(plan, q, kv, kv, rel_)
    set_run_option(monkeypatch, "fp32_tensor_cores", "1")
    assert not api.supports(plan, *(_FakeDev(x.shape, "float64") for x in (q, kv, kv)), rel_)
    assert not api.supports(plan, q, kv, kv, object())                                    # CSR & co
    for field, bad in (("score", "dot + edge bias"), ("scale", -1.0)):
        p2 = types.SimpleNamespace(**{**vars(plan), field: bad})
        assert not api.supports(p2, q, kv, kv, rel_), field
    assert api.supports(types.SimpleNamespace(**{**vars(plan), "prune_threshold": 0.5}), q, kv, kv, rel_)
    assert not api.supports(plan, np.zeros((10, 4, 64), np.float16), kv, kv, rel_)      # host array
    # compute capability 9.0 (wgmma): D = 32 and 96 too, every dtype
    monkeypatch.setattr(device, "use_wgmma", lambda dt: True)
    for d in (32, 96):
        qd, kvd = _FakeDev((10, 4, d)), _FakeDev((10, 2, d))
        assert api.supports(plan, qd, kvd, kvd, rel_)
        assert api.supports(plan, *(_FakeDev(x.shape, "float32") for x in (qd, kvd, kvd)), rel_)
    # D = 256 on wgmma: 16-bit plain calls, forward and backward (tuning.WGMMA_PLAIN_DIMS)
    q256, kv256 = _FakeDev((10, 4, 256)), _FakeDev((10, 2, 256))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (np.float16, ml_dtypes.bfloat16):
        x = [_FakeDev(a.shape, dt) for a in (q256, kv256, kv256)]
        assert api.supports(plan, *x, rel_)
        assert api.supports(types.SimpleNamespace(**{**vars(plan), "op": "forward"}), *x, rel_)
        assert api.supports(types.SimpleNamespace(**{**vars(plan), "op": "backward"}), *x, rel_)
        assert not api.supports(types.SimpleNamespace(**{**vars(plan), "score": "modified: f = s"}), *x, rel_)
        assert not api.supports(types.SimpleNamespace(**{**vars(plan), "prune_threshold": 0.5}), *x, rel_)
    assert not api.supports(plan, *(_FakeDev(a.shape, "float32") for a in (q256, kv256, kv256)), rel_)
    monkeypatch.setattr(device, "use_wgmma", lambda dt: False)   # elsewhere: 64 / 128 only
    assert not api.supports(plan, *(_FakeDev(x.shape, "float32") for x in (qd, kvd, kvd)), rel_)
    assert not api.supports(plan, q256, kv256, kv256, rel_)
    assert not api.supports(plan, _FakeDev((10, 4, 80)), _FakeDev((10, 2, 80)), _FakeDev((10, 2, 80)), rel_)


def test_operand_reads_aligned_strides_in_place():
    copies = []
    x = _FakeDev((10, 4, 64), strides=(4 * 64 * 2 * 3, 64 * 2 * 3, 2))   # every 3rd head slice: aligned
    _, ptr, rs, hs = api._operand(x, "q", copies)
    assert (rs, hs) == (4 * 64 * 6, 64 * 6) and copies == []
    _, ptr, rs, hs = api._operand(_FakeDev((10, 4, 64)), "k", copies)
    assert (rs, hs) == (512, 128) and copies == []


def test_head_dims_the_swizzle_cannot_serve_are_refused():
    for d in (32, 96):
        with pytest.raises(ValueError):
            G.Variant("fwd", d, d).check()


def _stub_launches(monkeypatch, k, refuse=(), unavailable=()):
    """Stub launch.Kernel's device query, path set-up and launch for kernel `k`: set-up of a
    path in `unavailable` raises; a launch on (path, device) in `refuse` raises. Returns the
    device cell and the lists of paths made and launches done."""
    from tiga_numba.cuda import launch
    dev = [0]
    monkeypatch.setattr(launch, "_get_device", lambda: dev[0])
    monkeypatch.setattr(launch, "_bind_context", lambda d: None)
    made, launched = [], []

    def make_path(name):
        if name in unavailable:
            raise ImportError(f"{name} is not installed")
        made.append((name, dev[0]))
        return (name, dev[0])

    def fake_launch(path, grid, block, stream, args):
        if (path[0], path[1]) in refuse:
            raise RuntimeError(f"{path[0]} refused on device {path[1]}")
        if args and args[0] == "bad":
            raise TypeError("a caller's bug")
        launched.append((path, args))

    monkeypatch.setattr(k, "_make_path", make_path)
    monkeypatch.setattr(k, "_launch", fake_launch)
    return dev, made, launched


def test_launch_paths_are_per_device_and_fall_back_once(monkeypatch):
    """launch.Kernel.__call__ (here a tensor-core kernel's) without a GPU: the launcher functions
    stubbed. A path refused on its first launch falls back to the next one that can be set up;
    each device gets its own path (a cubin loaded into one device's context must not be launched
    on another); a TypeError (wrong arguments) is the caller's and falls back to nothing."""
    k = build.TensorCoreKernel("tc_stub", "def kernel(a):\n    pass\n", "float16", 1, 0)
    dev, made, launched = _stub_launches(monkeypatch, k, refuse={("driver", 1)}, unavailable={"cupy"})
    k((1,), (32,), None, 7)
    k((1,), (32,), None, 8)
    assert made == [("driver", 0)] and launched == [(("driver", 0), (7,)), (("driver", 0), (8,))]
    assert k.launch_path == "driver"
    dev[0] = 1
    assert k.launch_path is None
    k((1,), (32,), None, 9)
    assert made[1:] == [("driver", 1), ("cuda.core", 1)] and launched[-1] == (("cuda.core", 1), (9,))
    assert k.launch_path == "cuda.core"
    # why: the driver's launch and cupy's set-up, in the order they were left
    assert [(d, name) for d, name, _ in k.fallbacks] == [(1, "driver"), (1, "cupy")], k.fallbacks
    assert "refused on device 1" in k.fallbacks[0][2] and "not installed" in k.fallbacks[1][2]
    dev[0] = 0
    assert k.launch_path == "driver"
    dev[0] = 2
    with pytest.raises(TypeError):
        k((1,), (32,), None, "bad")
    assert made[-1] == ("driver", 2) and k.launch_path is None


def test_a_launch_of_no_blocks_runs_nothing(monkeypatch):
    """A grid with a zero dimension (e.g. a split-row merge when no row was cut) is a no-op on
    every path: no path is set up, nothing is launched (cuLaunchKernel refuses it with
    CUDA_ERROR_INVALID_VALUE, and a first launch's refusal would wrongly fall back)."""
    k = build.TensorCoreKernel("tc_stub_empty", "def kernel(a):\n    pass\n", "float16", 1, 0)
    dev, made, launched = _stub_launches(monkeypatch, k)
    k((0, 1, 1), (32,), None, 7)
    k((4, 0), (32,), None, 7)
    assert made == [] and launched == []
    k((1,), (32,), None, 7)
    assert launched == [(("driver", 0), (7,))]


def test_wgmma_kernels_launch_from_their_cubin_only(monkeypatch):
    """a wgmma kernel exists for sm_90a only, which numba's own compile cannot target: it may take
    the cubin paths (driver, then cupy's call) and nothing else, whatever TIGA_NUMBA_LAUNCHER says."""
    from tiga_numba.cuda import launch
    k = build.TensorCoreKernel("tc_stub_wg", "def kernel(a):\n    pass\n", "float16", 1, 0, wgmma=True)
    assert k.launchers == launch.CUBIN_LAUNCHERS
    dev, made, launched = _stub_launches(monkeypatch, k, refuse={("driver", 0), ("cupy", 0)})
    with pytest.raises(RuntimeError, match="sm_90a cubin could not be launched"):
        k((1,), (32,), None, 1)
    assert made == [("driver", 0), ("cupy", 0)] and launched == []
    monkeypatch.setenv("TIGA_NUMBA_LAUNCHER", "numba")
    dev[0] = 1
    k((1,), (32,), None, 2)
    assert made[-1] == ("driver", 1) and k.launch_path == "driver"


def test_launch_passes_the_dynamic_shared_memory(monkeypatch):
    """the driver path hands the kernel's dyn_smem to cuLaunchKernel (and 0 for a kernel without)."""
    import numba

    from tiga_numba.cuda import launch
    seen = []

    def launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        seen.append((func, (gx, gy, gz), (bx, by, bz), smem, stream))

    stream = launch.StreamRef(77)
    for smem in (0, 99 * 1024):
        k = build.TensorCoreKernel("tc_stub_smem", "def kernel(a):\n    pass\n", "float16", 1, 0, dyn_smem=smem)
        k._launch(("driver", launch_kernel, 5, None, launch._Params((numba.int64,))), (3, 2), (128,), stream, (1,))
    assert seen == [(5, (3, 2, 1), (128, 1, 1), 0, 77), (5, (3, 2, 1), (128, 1, 1), 99 * 1024, 77)]


# ----------------------------------------------------------------------------- wgmma (sm_90a)
WG = dict(MT=1, a_smem=True, wgmma=True)


@pytest.mark.parametrize("D,H,Hkv,dtype,NW,BNq,BNk", [(64, 2, 1, "float16", 4, 64, 64),
                                                      (64, 3, 3, "bfloat16", 8, 128, 32),
                                                      (128, 2, 1, "float16", 4, 64, 32),
                                                      (128, 1, 1, "float16", 8, 128, 64),
                                                      (96, 2, 1, "float16", 8, 128, 64),    # padded rows
                                                      (32, 2, 2, "bfloat16", 4, 128, 128),
                                                      (64, 2, 1, "float32", 4, 64, 32),     # split: bf16 x 3
                                                      (128, 2, 2, "float32", 4, 32, 32),
                                                      (64, 1, 1, "float32", 8, 64, 16),
                                                      (96, 2, 1, "float32", 4, 32, 32),     # padded rows
                                                      (32, 2, 2, "float32", 8, 64, 32)])
@pytest.mark.parametrize("relname", list(RELATIONS))
def test_wgmma_forward_backward_emulated(D, H, Hkv, dtype, NW, BNq, BNk, relname):
    """the warpgroup kernels (descriptor-addressed operands, sub-tiled 128-byte-swizzled layout,
    register A for P B products) against the float64 oracle: every relation, GQA, one and two
    warpgroups, D = 64 (one column group), 128 (two sub-tiles), 96 and 32 (rows padded to whole
    sub-tile rows, pad zero-filled and never read), block widths 32 / 64 / 128."""
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(11 + D + NW + len(relname))
    q, k, v, do = _inputs(rng, dst[-1], src[-1], H, Hkv, D, dtype)
    scale = D ** -0.5
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, scale)
    vf = G.Variant("fwd", D, D, dtype=dtype, NW=NW, BN=BNq, **WG).check()
    o, m, l = E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), scale)
    assert np.isfinite(o).all() and rel(o, ro) < TOL[dtype]
    live = np.isfinite(rm)
    np.testing.assert_allclose(m[live], rm[live], rtol=1e-5, atol=1e-5)
    assert (m[~live] == -np.inf).all() and (l[~live] == 0).all() and (o[~live] == 0).all()
    vq = G.Variant("dq", D, D, dtype=dtype, NW=NW, BN=BNq, **WG).check()
    vk = G.Variant("dkdv", D, D, dtype=dtype, NW=NW, BN=BNk, **WG).check()
    out = rounded(ro.astype(np.float32), dtype)
    grads = E.backward(vq, vk, do, q, k, v, out, rm.astype(np.float32), rl.astype(np.float32),
                       dst, src, causal.astype(np.uint8), scale)
    for got, want in zip(grads, (rdq, rdk, rdv)):
        assert np.isfinite(got).all() and rel(got, want) < 3 * TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("relname", list(RELATIONS))
def test_wgmma_forward_head_dim_256_emulated(dtype, relname):
    """D = 256 (a plain-call head dim, tuning.WGMMA_PLAIN_DIMS): the shipped shape (two
    warpgroups, 64-key blocks, four 128-byte sub-tiles per row, one m64n256 P V chain) against the
    float64 oracle on every relation with GQA, and its pruned twin (rho tiny: every tile admitted,
    the exact result)."""
    import dataclasses
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(256 + len(relname) + len(dtype))
    q, k, v, do = _inputs(rng, dst[-1], src[-1], 4, 2, 256, dtype)
    scale = 256 ** -0.5
    ro, rm, rl, *_ = oracle(q, k, v, do, dst, src, causal, scale)
    vf = tuning.variant("fwd", 256, 256, dtype, wgmma=True).check()
    assert (vf.NW, vf.BN) == (8, 64) and 256 in tuning.WGMMA_PLAIN_DIMS
    live = np.isfinite(rm)
    for x, rho in ((vf, None), (dataclasses.replace(vf, prune=True), 1e-30)):
        o, m, l = E.forward(x, q, k, v, dst, src, causal.astype(np.uint8), scale, rho=rho)
        assert np.isfinite(o).all() and rel(o, ro) < TOL[dtype], (x.prune, rel(o, ro))
        np.testing.assert_allclose(m[live], rm[live], rtol=1e-5, atol=1e-5)
        assert (m[~live] == -np.inf).all() and (l[~live] == 0).all() and (o[~live] == 0).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("relname", list(RELATIONS))
def test_wgmma_backward_head_dim_256_emulated(dtype, relname):
    """D = 256 backward as shipped: the dQ kernel and the dK/dV kernel keeping half of the dK and dV
    columns per CTA (Variant.col_parts = 2, grid z = the part), against the float64 oracle on every
    relation with GQA, from the forward's own (m, l)."""
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(2560 + len(relname) + len(dtype))
    q, k, v, do = _inputs(rng, dst[-1], src[-1], 4, 2, 256, dtype)
    scale = 256 ** -0.5
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, scale)
    vq, vk = tuning.backward_variants(256, 256, dtype, wgmma=True)
    assert vk.col_parts == 2 and 256 in tuning.head_dims(dtype, True, "backward")
    vf = tuning.variant("fwd", 256, 256, dtype, wgmma=True)
    o, m, l = E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), scale)
    grads = E.backward(vq, vk, do, q, k, v, o, m, l, dst, src, causal.astype(np.uint8), scale)
    for got, want in zip(grads, (rdq, rdk, rdv)):
        assert np.isfinite(got).all() and rel(got, want) < 3 * TOL[dtype], rel(got, want)


def test_dkdv_column_parts_change_no_arithmetic(monkeypatch):
    """a dK/dV kernel in column parts gives the bits of the whole-width kernel (each part computes
    S^T and dP^T as the whole one does and keeps its own columns of dK and dV); a part that reads
    the wrong columns of the streamed tiles is caught. Refused where the parts are not whole
    sub-tiles or the kernel is not a 16-bit, unfused wgmma dK/dV kernel."""
    import dataclasses
    dst, src, causal = (np.array(x) for x in RELATIONS["segments"])
    rng = np.random.default_rng()
    q, k, v, do = _inputs(rng, dst[-1], src[-1], 2, 1, 128, "float16")
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, 0.1)
    whole = G.Variant("dkdv", 128, 128, NW=4, BN=64, **WG).check()
    args = (do, q, k, v, rounded(ro.astype(np.float32), "float16"), rm.astype(np.float32), rl.astype(np.float32),
            dst, src, causal.astype(np.uint8), 0.1)
    want = E.backward(None, whole, *args)[1:]
    got = E.backward(None, dataclasses.replace(whole, col_parts=2).check(), *args)[1:]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    gen = G.gen_dkdv
    monkeypatch.setattr(E.G, "gen_dkdv", lambda vr: gen(vr).replace("po = u32(part * ", "po = u32(0 * "))
    bad = E.backward(None, dataclasses.replace(whole, col_parts=2), *args)
    assert rel(bad[2], rdv) > 0.1 and rel(bad[1], rdk) < 3 * TOL["float16"]
    for bad_fields in (dict(col_parts=4), dict(col_parts=2, dtype="float32"), dict(col_parts=2, wgmma=False),
                       dict(col_parts=2, fuse_dq=True), dict(col_parts=2, kind="dq")):
        with pytest.raises(ValueError, match="col_parts"):
            dataclasses.replace(whole, **bad_fields).check()


@pytest.mark.parametrize("relname", ["segments", "causal_tail", "empty_keys"])
def test_dkdv_statistics_through_shared_memory_change_no_arithmetic(monkeypatch, relname):
    """the dK/dV kernel's per-query statistics copied to shared memory with each query block
    (Variant.stats_smem: 8- and 4-byte cp.async, copies.py) give the bits of the loads from global
    memory, with GQA, tails (zero-filled queries past the block) and the block loop across heads;
    reading a wrong slot or row of the copy is caught."""
    import dataclasses
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng()
    q, k, v, do = _inputs(rng, dst[-1], src[-1], 4, 2, 64, "float16")
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, 0.125)
    args = (do, q, k, v, rounded(ro.astype(np.float32), "float16"), rm.astype(np.float32), rl.astype(np.float32),
            dst, src, causal.astype(np.uint8), 0.125)
    for shape in (dict(NW=4, BN=64), dict(NW=8, BN=32), dict(NW=4, BN=128), dict(NW=4, BN=64, overlap=False)):
        shipped = G.Variant("dkdv", 64, 64, **shape, **WG).check()
        assert shipped.stats_in_smem and "cp_async8_if" in G.gen_dkdv(shipped)
        loads = dataclasses.replace(shipped, stats_smem=False)
        assert not loads.stats_in_smem and "cp_async8_if" not in G.gen_dkdv(loads)
        got, want = E.backward(None, shipped, *args)[1:], E.backward(None, loads, *args)[1:]
        for g, w, r in zip(got, want, (rdk, rdv)):
            np.testing.assert_array_equal(g, w)
            assert rel(g, r) < 3 * TOL["float16"]
    if relname != "segments":
        return
    gen = G.gen_dkdv
    for old, bad in (("ssc = a32(sst, u32(cur * ", "ssc = a32(sst, u32((1 - cur) * "), ("u32(sr * 8)", "u32(sr * 8 + 16)")):
        monkeypatch.setattr(E.G, "gen_dkdv", lambda vr, old=old, bad=bad: gen(vr).replace(old, bad))
        try:   # a wrong result, or NaN bytes of the copy reaching a product (the emulator's check)
            got = E.backward(None, G.Variant("dkdv", 64, 64, NW=4, BN=64, **WG).check(), *args)[1:]
        except AssertionError as exc:
            assert "not fully defined" in str(exc)
            continue
        assert not all(np.isfinite(g).all() and rel(g, r) < 3 * TOL["float16"] for g, r in zip(got, (rdk, rdv))), old


#: fused wgmma backward shapes: (D, H, Hkv, dtype, NW, BN); one / two warpgroups, one / two dQ row
#: units per warpgroup, two column units (NW = 8, BN = 64), D = 32 / 64 / 96 / 128
WG_FUSED = [(64, 2, 1, "float16", 4, 64), (64, 2, 1, "float16", 8, 64), (64, 1, 1, "bfloat16", 4, 128),
            (128, 2, 1, "float16", 8, 64), (32, 2, 2, "float16", 8, 128), (96, 2, 1, "float16", 4, 64)]


@pytest.mark.parametrize("atomic", [False, True], ids=["ordered", "atomic"])
@pytest.mark.parametrize("D,H,Hkv,dtype,NW,BN", WG_FUSED)
@pytest.mark.parametrize("relname", list(RELATIONS))
def test_wgmma_fused_backward_emulated(D, H, Hkv, dtype, NW, BN, atomic, relname):
    """the fused dK/dV/dQ kernel on wgmma: dS^T leaves the registers as a query-major tile in the
    wgmma layout, dQ units are st chains (A = dS K-major, B = the resident K tile MN-major), added in
    key-tile order to a poisoned accumulator (ordered) or with red.global (atomic)."""
    if D == 96 and not atomic:
        with pytest.raises(ValueError, match="16-byte passes"):
            G.Variant("dkdv", D, D, dtype=dtype, NW=NW, BN=BN, fuse_dq=True, **WG).check()
        return
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(7 + D + NW + len(relname))
    q, k, v, do = _inputs(rng, dst[-1], src[-1], H, Hkv, D, dtype)
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, D ** -0.5)
    vk = G.Variant("dkdv", D, D, dtype=dtype, NW=NW, BN=BN, fuse_dq=True, dq_atomic=atomic, **WG).check()
    got = E.backward(None, vk, do, q, k, v, rounded(ro.astype(np.float32), dtype), rm.astype(np.float32),
                     rl.astype(np.float32), dst, src, causal.astype(np.uint8), D ** -0.5)
    for g, want in zip(got, (rdq, rdk, rdv)):
        assert np.isfinite(g).all() and rel(g, want) < 3 * TOL[dtype]


@pytest.mark.parametrize("dtype,NW,BN", [("float16", 4, 128), ("bfloat16", 8, 64), ("float32", 4, 32)])
def test_wgmma_overlap_changes_no_arithmetic(dtype, NW, BN):
    """the backward's overlapped chains (dP, 16-bit dV issued without waiting, Variant.overlap) give
    the same bits as every chain waited for at once: only the order of independent work moved."""
    import dataclasses
    dst, src, causal = (np.array(x) for x in RELATIONS["segments"])
    rng = np.random.default_rng()
    q, k, v, do = _inputs(rng, dst[-1], src[-1], 2, 1, 64, dtype)
    ro, rm, rl, *_ = oracle(q, k, v, do, dst, src, causal, 0.125)
    grads = []
    for overlap in (True, False):
        vq = G.Variant("dq", 64, 64, dtype=dtype, NW=NW, BN=BN, overlap=overlap, **WG).check()
        vk = dataclasses.replace(vq, kind="dkdv").check()
        assert ("_so" in vk.name()) == (not overlap)
        grads.append(E.backward(vq, vk, do, q, k, v, rounded(ro.astype(np.float32), dtype), rm.astype(np.float32),
                                rl.astype(np.float32), dst, src, causal.astype(np.uint8), 0.125))
    for a, b in zip(*grads):
        assert np.isfinite(a).all() and np.array_equal(a, b)


#: key blocks narrow enough that these small relations give a query tile several of them (a wrong
#: rescale between blocks shows)
@pytest.mark.parametrize("D,H,Hkv,dtype,NW,BN", [(64, 2, 1, "float16", 4, 32), (128, 3, 1, "bfloat16", 8, 64),
                                                  (96, 2, 2, "float16", 8, 32)])
@pytest.mark.parametrize("relname", list(RELATIONS))
def test_pipelined_forward_changes_no_arithmetic(D, H, Hkv, dtype, NW, BN, relname):
    """the pipelined forward (P V of block j - 1 in flight during the softmax of block j,
    Variant.fwd_pipelined) gives the serial forward's bits: O gets the same products, rescalings
    and additions in the same order; the extra first chain (P = 0 times a zero-filled V slot) adds
    exact zeros. Also against the float64 oracle: the serial one could share a bug."""
    import dataclasses
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng()
    q, k, v, do = _inputs(rng, dst[-1], src[-1], H, Hkv, D, dtype)
    ro, rm, *_ = oracle(q, k, v, do, dst, src, causal, D ** -0.5)
    vp = G.Variant("fwd", D, D, dtype=dtype, NW=NW, BN=BN, **WG).check()
    vs = dataclasses.replace(vp, overlap=False).check()
    assert vp.fwd_pipelined and not vs.fwd_pipelined and vs.name() == vp.name() + "_so"
    got = [E.forward(x, q, k, v, dst, src, causal.astype(np.uint8), D ** -0.5) for x in (vp, vs)]
    for a, b in zip(*got):
        assert np.array_equal(a, b)
    assert np.isfinite(got[0][0]).all() and rel(got[0][0], ro) < TOL[dtype]


@pytest.mark.parametrize("mistake", ["v_slot", "no_wait"])
def test_pipelined_forward_mistakes_are_caught(monkeypatch, mistake):
    """the emulator's model of asynchrony catches the pipeline's two ways to go wrong: V of block kb
    copied into the slot P V of block kb - 1 is still reading (the chain's operands change while
    in flight), and a loop that does not wait for its copies (cp.async chunks land only at the
    wait, NaN until then). Each mistake is made in the generated text; the test can fail."""
    dst, src, causal = (np.array(x) for x in RELATIONS["causal_tail"])
    q, k, v, do = _inputs(np.random.default_rng(3), dst[-1], src[-1], 2, 1, 64, "float16")
    ro, *_ = oracle(q, k, v, do, dst, src, causal, 0.125)
    vp = G.Variant("fwd", 64, 64, NW=4, BN=32, **WG).check()
    text = G.gen_forward(vp)
    if mistake == "v_slot":   # V of block kb into slot prv: where P V of block kb - 1 reads
        bad = text.replace(f"a32(ss, u32({2 * 32 * 128} + (cur) * {32 * 128}))",
                           f"a32(ss, u32({2 * 32 * 128} + (prv) * {32 * 128}))")
    else:
        bad = text.replace("\n        cp_wait0()\n", "\n", 1)   # the key loop's wait (the first indented one)
    assert bad != text
    monkeypatch.setattr(E.G, "gen_forward", lambda v: bad)
    try:
        o, *_ = E.forward(vp, q, k, v, dst, src, causal.astype(np.uint8), 0.125)
    except AssertionError as ex:
        assert "wgmma" in str(ex), ex
        return
    assert not (np.isfinite(o).all() and rel(o, ro) < 1e-2)


def loop_body(lines):
    """(index of the `for` line, the body's indentation, the body's lines) of a kernel text's
    streamed loop (the first `for kb in range(nkb):` or `for it in range(nit):`)."""
    start = next(i for i, ln in enumerate(lines) if ln.strip() in ("for kb in range(nkb):", "for it in range(nit):"))
    inner = " " * (len(lines[start]) - len(lines[start].lstrip()) + 4)
    body = []
    for ln in lines[start + 1:]:
        if ln.strip() and not ln.startswith(inner):
            break
        body.append(ln)
    return start, inner, body


@pytest.mark.parametrize("D,H,Hkv,dtype,BN,slots", [(64, 2, 1, "float16", 32, 0), (128, 3, 1, "bfloat16", 64, 0),
                                                     (96, 2, 2, "float16", 32, 0), (64, 2, 1, "float16", 32, 2)])
@pytest.mark.parametrize("relname", list(RELATIONS))
def test_pingpong_forward_changes_no_arithmetic(D, H, Hkv, dtype, BN, slots, relname):
    """the ping-pong forward (two warpgroups taking turns, fed by the mbarrier ring instead of CTA
    barriers, Variant.pingpong; three V slots, or two) gives the pipelined forward's bits: only who
    waits for what changed. Also against the float64 oracle."""
    import dataclasses
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng()
    q, k, v, do = _inputs(rng, dst[-1], src[-1], H, Hkv, D, dtype)
    ro, *_ = oracle(q, k, v, do, dst, src, causal, D ** -0.5)
    vp = G.Variant("fwd", D, D, dtype=dtype, NW=8, BN=BN, **WG).check()
    vq = dataclasses.replace(vp, pingpong=True, ring_v_slots=slots).check()
    assert vq.name() == vp.name() + ("_pp2" if slots == 2 else "_pp") and vq.pingpong_loop and vq.v_slots == (slots or 3)
    got = [E.forward(x, q, k, v, dst, src, causal.astype(np.uint8), D ** -0.5) for x in (vp, vq)]
    for a, b in zip(*got):
        assert np.array_equal(a, b)
    assert np.isfinite(got[1][0]).all() and rel(got[1][0], ro) < TOL[dtype]


#: mistakes in the ping-pong ring, each made in the generated text (D = 64, BN = 32):
#: (the text to replace, its replacement, how many times)
PINGPONG_MISTAKES = {
    # the loop reads its stage without waiting for the copies' barrier
    "no_full_wait": ("        mbar_wait(a32(rb, u32(u32(kb) & u32(1)) * u32(8)), (u32(kb) >> u32(1)) & u32(1)); fence_async()\n",
                     "", 1),
    # K slot refilled after waiting for the wrong release phase of it
    "k_parity": ("((ku - u32(1)) >> u32(1))", "((ku) >> u32(1))", 1),
    "v_parity": ("((ku - u32(2)) // u32(3))", "((ku - u32(1)) // u32(3))", 1),
    # V of block kb copied into the slot P V of block kb - 1 is still reading
    "v_slot": ("vsw = (ku + u32(1)) % u32(3)", "vsw = vsr", 1),
    # S's release of its K slot left out
    "no_release": ("        mbar_arrive(a32(rb, u32(16) + u32(cur) * u32(8)))\n", "", 1),
}


@pytest.mark.parametrize("mistake", list(PINGPONG_MISTAKES))
def test_pingpong_ring_mistakes_are_caught(monkeypatch, mistake):
    """the emulator's mbarrier model (phases, parity waits, copies landing only at a wait that
    covers them) catches each way the ring's bookkeeping can go wrong: a wait that would hang on a
    GPU fails, data read before it landed is NaN, a slot refilled under an in-flight chain changes
    its operands. The test can fail."""
    dst, src, causal = (np.array(x) for x in RELATIONS["causal_tail"])
    q, k, v, do = _inputs(np.random.default_rng(3), dst[-1], src[-1], 2, 1, 64, "float16")
    ro, *_ = oracle(q, k, v, do, dst, src, causal, 0.125)
    vq = G.Variant("fwd", 64, 64, NW=8, BN=32, pingpong=True, **WG).check()
    text = G.gen_forward(vq)
    old, new, count = PINGPONG_MISTAKES[mistake]
    assert text.count(old) >= 1
    bad = text.replace(old, new, count)
    monkeypatch.setattr(E.G, "gen_forward", lambda v: bad)
    try:
        o, *_ = E.forward(vq, q, k, v, dst, src, causal.astype(np.uint8), 0.125)
    except AssertionError as ex:
        assert "mbarrier" in str(ex) or "wgmma" in str(ex), ex
        return
    assert not (np.isfinite(o).all() and rel(o, ro) < 1e-2)


def test_pingpong_loop_has_no_cta_barrier():
    """the ping-pong key loop synchronises through the ring and the two named barriers only: the
    CTA barriers left in it are the guard's, inside the branch taken by blocks with masked cells;
    each warpgroup takes its turn once per block and hands it over once; elsewhere the option is inert."""
    import dataclasses
    v = G.Variant("fwd", 128, 128, NW=8, BN=128, pingpong=True, **WG).check()
    lines = G.gen_forward(v).split("\n")
    _, inner, body = loop_body(lines)
    top = [ln for ln in body if ln.startswith(inner) and not ln.startswith(inner + " ")]
    assert not any("syncthreads" in ln for ln in top), top
    assert sum(ln.strip().startswith("bar_sync_n(own") for ln in top) == 1
    assert sum(ln.strip().startswith("bar_arrive_n(other") for ln in top) == 1
    assert v.smem_bytes() <= G.MAX_SMEM
    # where the loop is not the pipelined one with two warpgroups, pingpong changes nothing
    for other in (dict(NW=4), dict(overlap=False), dict(prune=True)):
        plain = G.Variant("fwd", 64, 64, BN=64, **dict(dict(WG, NW=8), **other)).check()
        asked = dataclasses.replace(plain, pingpong=True).check()
        assert not asked.pingpong_loop and G.gen_forward(asked) == G.gen_forward(plain)
    assert not G.Variant("dq", 64, 64, NW=8, BN=64, pingpong=True, **WG).check().pingpong_loop
    assert not G.Variant("fwd", 64, 64, NW=8, BN=64, pingpong=True).check().pingpong_loop   # mma.sync


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("wgmma", [True, False])
def test_streamed_loops_wait_for_their_copies_once_per_block(monkeypatch, kind, wgmma):
    """the serial key loop (forward, dQ) and the dK/dV query loop (StreamedPair.advance) wait for
    the block's copies at the top of each iteration, then meet at ONE CTA barrier, and refill the
    other slot right after it; the loop body holds no second barrier. Without that wait the block's
    cp.async chunks have not landed (NaN in the emulator until the covering wait): the kernel must
    fail (the test can fail)."""
    dst, src, causal = (np.array(x) for x in RELATIONS["causal_tail"])
    q, k, v, do = _inputs(np.random.default_rng(5), dst[-1], src[-1], 2, 1, 64, "float16")
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, 0.125)
    shape = dict(WG, NW=4, BN=32) if wgmma else dict(NW=4, BN=32, MT=1)
    vs = {x: G.Variant(x, 64, 64, overlap=False, **shape).check() for x in ("fwd", "dq", "dkdv")}   # the serial loops
    text = G.GENERATORS[kind](vs[kind])
    lines = text.split("\n")
    start, inner, body = loop_body(lines)
    top = []   # the iteration's straight-line head, up to its first branch
    for ln in body:
        if ln.startswith(inner + "if "):
            break
        top.append(ln)
    assert inner + "cp_wait0()" in top and sum(ln.count("cuda.syncthreads()") for ln in top) == 1, top
    last = [ln for ln in body if ln.startswith(inner) and not ln.startswith(inner + " ")][-1]
    assert "syncthreads" not in last, last   # no barrier closes the iteration
    wait = start + 1 + body.index(inner + "cp_wait0()")
    bad = "\n".join(lines[:wait] + lines[wait + 1:])
    assert bad != text
    monkeypatch.setattr(E.G, {"fwd": "gen_forward", "dq": "gen_dq", "dkdv": "gen_dkdv"}[kind], lambda v: bad)
    try:
        if kind == "fwd":
            got = [E.forward(vs["fwd"], q, k, v, dst, src, causal.astype(np.uint8), 0.125)[0]]
            want = [ro]
        else:
            got = E.backward(vs["dq"], vs["dkdv"], do, q, k, v, rounded(ro.astype(np.float32), "float16"),
                             rm.astype(np.float32), rl.astype(np.float32), dst, src, causal.astype(np.uint8), 0.125)
            got, want = [got[0 if kind == "dq" else 1]], [rdq if kind == "dq" else rdk]
    except AssertionError as ex:
        assert "wgmma" in str(ex) or "mma operand" in str(ex) or "cp.async" in str(ex), ex
        return
    assert not all(np.isfinite(g).all() and rel(g, w) < 1e-2 for g, w in zip(got, want))


@pytest.mark.parametrize("kind", ["dq", "dkdv"])
def test_reading_an_in_flight_accumulator_is_caught(monkeypatch, kind):
    """without its wgmma_wait the overlapped dP (dV) chain's registers hold no result: the emulator
    poisons them until the wait, so a kernel reading them early fails (the test can fail)."""
    patch_generator(monkeypatch, "wg_wait", lambda *a: None)
    dst, src, causal = (np.array(x) for x in RELATIONS["causal_tail"])
    q, k, v, do = _inputs(np.random.default_rng(1), dst[-1], src[-1], 1, 1, 64, "float16")
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, 0.125)
    vq = G.Variant("dq", 64, 64, NW=4, BN=64, overlap=kind == "dq", **WG).check()
    vk = G.Variant("dkdv", 64, 64, NW=4, BN=64, overlap=kind == "dkdv", **WG).check()
    try:
        got = E.backward(vq, vk, do, q, k, v, rounded(ro.astype(np.float32), "float16"), rm.astype(np.float32),
                         rl.astype(np.float32), dst, src, causal.astype(np.uint8), 0.125)
    except AssertionError as ex:
        assert "wgmma" in str(ex) or "mma operand" in str(ex), ex
        return
    assert not all(np.isfinite(g).all() and rel(g, w) < 1e-2 for g, w in zip(got, (rdq, rdk, rdv)))


def test_wgmma_fused_rules():
    """what the wgmma dQ units cannot tile is refused with the argument named, not mis-tiled."""
    assert G.Variant("dkdv", 64, 64, NW=8, BN=64, fuse_dq=True, **WG).wg_dq_units() == (1, 2, 32, 1)
    assert G.Variant("dkdv", 64, 64, NW=4, BN=128, fuse_dq=True, **WG).wg_dq_units() == (2, 1, 64, 2)
    with pytest.raises(ValueError, match="units of 64 query rows"):
        G.Variant("dkdv", 64, 64, NW=4, BN=32, fuse_dq=True, **WG).check()
    with pytest.raises(ValueError, match="16-bit only"):
        G.Variant("dkdv", 64, 64, dtype="float32", NW=4, BN=64, fuse_dq=True, **WG).check()


@pytest.mark.parametrize("scales", [(1e-6, 1e6, 1e30), (1e15, 1e-15, 1e-30)])
def test_split_holds_far_from_one(scales):
    """float32 on wgmma needs no scaling: bfloat16 parts have float32's exponent range, so inputs
    scaled far from 1 stay fp32-class (down to ~1e-33, where the lo parts turn subnormal)."""
    dst, src, causal = (np.array(x) for x in RELATIONS["dense_rect_tail"])
    q, k, v, _ = _inputs(np.random.default_rng(2), dst[-1], src[-1], 1, 1, 64, "float32")
    q, k, v = (x * np.float32(f) for x, f in zip((q, k, v), scales))
    ro, *_ = oracle(q, k, v, q, dst, src, causal, 0.125)
    vf = G.Variant("fwd", 64, 64, dtype="float32", NW=4, BN=64, **WG).check()
    assert rel(E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), 0.125)[0], ro) < 1e-6


@pytest.mark.parametrize("relname", ["causal_tail", "segments"])
def test_split_narrow_value_chains(relname):
    """float32 on wgmma with 32-column P B chains (Variant.pb_cols, the shipped D = 128 dK/dV): each
    chain starts 64 bytes into the B rows' swizzled 128-byte lines; GQA, tails, causal."""
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    q, k, v, do = _inputs(np.random.default_rng(len(relname)), dst[-1], src[-1], 2, 1, 128, "float32")
    scale = 128 ** -0.5
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, scale)
    vf = G.Variant("fwd", 128, 128, dtype="float32", NW=4, BN=32, pb_cols=32, **WG).check()
    assert rel(E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), scale)[0], ro) < TOL["float32"]
    vq = G.Variant("dq", 128, 128, dtype="float32", NW=4, BN=32, pb_cols=32, **WG).check()
    vk = G.Variant("dkdv", 128, 128, dtype="float32", NW=4, BN=32, pb_cols=32, **WG).check()
    grads = E.backward(vq, vk, do, q, k, v, ro.astype(np.float32), rm.astype(np.float32), rl.astype(np.float32),
                       dst, src, causal.astype(np.uint8), scale)
    for got, want in zip(grads, (rdq, rdk, rdv)):
        assert rel(got, want) < 3 * TOL["float32"]


@pytest.mark.parametrize("broken", ["sbo", "k_step", "sub_tile"])
def test_wgmma_broken_descriptor_is_caught(monkeypatch, broken):
    """a wrong descriptor (8-row stride), k-step advance or sub-tile offset must fail (the test can fail)."""
    if broken == "sbo":
        real = GW.wg_desc
        patch_generator(monkeypatch, "wg_desc", lambda addr, lbo: real(addr, lbo, sbo=512))
    elif broken == "k_step":
        real_chain = GSrc.Source.chain

        def chain(self, form, N, steps, wait=True):
            steps = list(steps)
            if form == "ss":   # k-step 1 of B re-reads k-step 0
                steps[1] = (steps[1][0], steps[0][1])
            return real_chain(self, form, N, steps, wait)
        monkeypatch.setattr(GSrc.Source, "chain", chain)
    else:
        real_load = GS.load_tile

        def load(e, v, smem, gbase, gstride, nvalid, rows, width, **kw):
            sub = GSrc.Source()
            real_load(sub, v, smem, gbase, gstride, nvalid, rows, width, **kw)
            for line in sub.lines:
                e(line.replace(f"* {rows * 128})", "* 128)"))   # sub-tiles overlap the first one
        patch_generator(monkeypatch, "load_tile", load)
    D = 128 if broken == "sub_tile" else 64
    dst, src, causal = (np.array(x) for x in RELATIONS["dense_rect_tail"])
    rng = np.random.default_rng(5)
    q, k, v, _ = _inputs(rng, dst[-1], src[-1], 1, 1, D, "float16")
    vf = G.Variant("fwd", D, D, NW=4, BN=64, **WG).check()
    ro, *_ = oracle(q, k, v, q, dst, src, causal, 0.125)
    try:
        o, _, _ = E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), 0.125)
    except AssertionError as ex:   # the emulator refused the operands (addresses or unloaded bytes)
        assert "wgmma operand" in str(ex) or "shared" in str(ex), ex
        return
    assert rel(o, ro) > 1e-2


@pytest.mark.parametrize("passes", [(("hi", "hi"),), GV.SPLIT_PASSES[2:]])
def test_split_needs_every_pass(monkeypatch, passes):
    """float32 on wgmma: the six passes are fp32-class (< 1e-6 here, ~3e-7), plain bf16 (hi x hi,
    ~3e-3) and the four passes without the lo parts (16-bit mantissas, ~5e-6) are not."""
    dst, src, causal = (np.array(x) for x in RELATIONS["dense_rect_tail"])
    q, k, v, _ = _inputs(np.random.default_rng(3), dst[-1], src[-1], 1, 1, 64, "float32")
    ro, *_ = oracle(q, k, v, q, dst, src, causal, 0.125)

    def run():
        vf = G.Variant("fwd", 64, 64, dtype="float32", NW=4, BN=64, **WG).check()
        return rel(E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), 0.125)[0], ro)
    assert run() < 1e-6
    patch_generator(monkeypatch, "SPLIT_PASSES", passes)
    assert run() > 2e-6


def test_wgmma_variant_rules():
    for bad in (dict(MT=2), dict(NW=6), dict(a_smem=False)):
        with pytest.raises(ValueError, match="wgmma"):
            G.Variant("fwd", 64, 64, NW=bad.get("NW", 4), BN=64, MT=bad.get("MT", 1),
                      a_smem=bad.get("a_smem", True), wgmma=True).check()
    with pytest.raises(ValueError, match="shared memory"):   # three bf16 parts + staging: too big
        G.Variant("fwd", 128, 128, dtype="float32", NW=8, BN=128, **WG).check()
    assert G.Variant("fwd", 64, 64, dtype="float32", NW=4, BN=64, **WG).check().split
    for table, dt in ((tuning.TUNING_WGMMA, "float16"), (tuning.TUNING_WGMMA_F32, "float32")):
        for (kind, D), shape in table.items():
            assert G.Variant(kind, D, D, dtype=dt, **shape).check().wgmma
    assert ("wg:fwd", 128, "bfloat16") in build.shipped_kernels()
    with pytest.raises(ValueError, match="sm_90a"):
        build.kernel(tuning.variant("fwd", 64, 64, "float16", wgmma=True))[0].cubin("sm_80")


@pytest.mark.parametrize("kind,D,NW,BN,prune,dtype", [("fwd", 64, 8, 128, False, "float16"),
                                                      ("dq", 128, 4, 64, False, "float16"),
                                                      ("dkdv", 128, 4, 32, False, "float16"),
                                                      ("fwd", 96, 8, 128, True, "float16"),
                                                      ("dq", 64, 4, 64, False, "float32"),    # split
                                                      ("fwd", 256, 8, 64, False, "bfloat16"),
                                                      ("fwd", 128, 8, 128, False, "float16"),   # shipped
                                                      ("fwd", 64, 4, 128, False, "bfloat16")])
def test_wgmma_ptx_links_for_sm90a_without_serialisation(kind, D, NW, BN, prune, dtype):
    """numba's PTX of a warpgroup kernel links for sm_90a (nvJitLink, no GPU): every product is one
    wgmma chain (fence ... commit, wait), shared memory is fenced for the async proxy, no local
    arrays or spills, and ptxas does not serialise the wgmma (a 64-bit division, a subroutine call
    in SASS, once did: C7509)."""
    pytest.importorskip("numba_cuda")
    pytest.importorskip("cuda.core")
    import re

    v = G.Variant(kind, D, D, dtype=dtype, NW=NW, BN=BN, prune=prune, **WG).check()
    rep = build.kernel(v)[0].ptxas("sm_90a")
    ptx = rep["ptx"]
    # (A B^T, P B) products per block; the pipelined forward has its last block's P V after the loop
    products = {"fwd": (1, 2 if v.fwd_pipelined else 1), "dq": (2, 1), "dkdv": (2, 2)}[kind]
    passes, groups = len(GW._passes(v)), len(GV.pb_groups(v, D))   # float32: 6 passes, a chain per group
    nk_abt, nk_pb = D // 16, BN // 16
    assert ptx.count("wgmma.mma_async.sync.aligned") == passes * (products[0] * nk_abt + products[1] * groups * nk_pb)
    chains = products[0] + products[1] * groups
    # one commit per chain; as many waits (the backward's dP, 16-bit dV chains are issued without
    # one and waited for after the CUDA-core work they overlap; the pipelined forward's loop waits
    # for S with P V still in flight, then for P V)
    assert ptx.count("wgmma.commit_group.sync.aligned") == ptx.count("wgmma.wait_group.sync.aligned") == chains
    if v.fwd_pipelined:
        assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "fence.proxy.async.shared::cta" in ptx and ".local" not in ptx
    assert not re.search(r"\b(div|rem)\.[su]64\b", ptx)
    assert rep["regs"] and not rep["serialised"], rep["log"]
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["log"]



@pytest.mark.parametrize("atomic", [False, True], ids=["ordered", "atomic"])
def test_wgmma_fused_ptx_links_for_sm90a(atomic):
    """the fused wgmma backward links for sm_90a without spills or serialisation: the dK/dV kernel's
    four chains plus one st chain (B transposed) per dQ unit; ordered: the turn counter at GPU scope and
    no float atomics; atomic: red.global.add.v2.f32."""
    pytest.importorskip("numba_cuda")
    pytest.importorskip("cuda.core")
    import re

    v = G.Variant("dkdv", 64, 64, NW=8, BN=64, fuse_dq=True, dq_atomic=atomic, **WG).check()
    rep = build.kernel(v)[0].ptxas("sm_90a")
    ptx = rep["ptx"]
    per = v.wg_dq_units()[3]
    assert ptx.count("wgmma.mma_async.sync.aligned") == 2 * (64 // 16) + 2 * (v.BN // 16) + per * (v.BM // 16)
    assert ptx.count("wgmma.commit_group.sync.aligned") == ptx.count("wgmma.wait_group.sync.aligned") == 4 + per
    assert ptx.count("1, 1, 1, 0, 1;") == per * (v.BM // 16)   # imm-trans-b: dQ's B = K read MN-major
    if atomic:
        assert "red.global.add.v2.f32" in ptx
    else:
        assert "ld.acquire.gpu.global.u32" in ptx and "st.release.gpu.global.u32" in ptx
        assert not re.search(r"\b(atom|red)\.", ptx)
    assert ".local" not in ptx and rep["regs"] and not rep["serialised"], rep["log"]
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["log"]


# ----------------------------------------------------------------------------- tile pruning
def prune_oracle(q, k, v, dst, src, causal, scale, rho, BM, BN):
    """float64 replay of the pruned forward: the kernel's tiles (BM query rows x BN keys), its
    visiting order (from the key block facing the query tile, wrapping) and docs/design.md's rule (admit iff the query tile's running max is unset or
    max(tile scores) >= running max + ln(rho), both over the tile's real rows). Returns the
    output over the admitted entries and (pruned, visited) tile counts."""
    nd, H, D = q.shape
    g = H // k.shape[1]
    out = np.zeros((nd, H, v.shape[2]))
    pruned = visited = 0
    for b in range(len(causal)):
        i0, i1, j0, j1 = dst[b], dst[b + 1], src[b], src[b + 1]
        cols = j1 - j0
        for t0 in range(0, i1 - i0, BM):
            rows = min(BM, i1 - i0 - t0)
            kend = min(cols, t0 + rows) if causal[b] else cols
            nkb = -(-kend // BN)
            start = min(t0 // BN, nkb - 1)
            order = [(it + start) % nkb for it in range(nkb)]
            for h in range(H):
                qq = q[i0 + t0:i0 + t0 + rows, h].astype(np.float64)
                s = qq @ k[j0:j1, h // g].astype(np.float64).T * scale
                if causal[b]:
                    s = np.where(np.arange(cols)[None, :] <= t0 + np.arange(rows)[:, None], s, -np.inf)
                keep = np.zeros_like(s, bool)
                run = np.full(rows, -np.inf)
                if nkb:   # the order's promise: every row meets a real key in its first tile
                    assert np.isfinite(s[:, order[0] * BN:(order[0] + 1) * BN]).any(1).all()
                for kb in order:
                    tile = s[:, kb * BN:(kb + 1) * BN]
                    R = run.max()
                    if R == -np.inf or tile.max() >= R + np.log(rho):
                        keep[:, kb * BN:(kb + 1) * BN] = True
                        run = np.maximum(run, tile.max(1))
                    else:
                        pruned += 1
                visited += nkb
                ss = np.where(keep, s, -np.inf)
                mx = ss.max(1, keepdims=True)
                p = np.where(np.isfinite(mx), np.exp(ss - np.where(np.isfinite(mx), mx, 0)), 0)
                l = p.sum(1, keepdims=True)
                out[i0 + t0:i0 + t0 + rows, h] = np.where(l > 0, p @ v[j0:j1, h // g] / np.where(l > 0, l, 1), 0)
    return out, pruned, visited


def _local_inputs(rng, n, H, Hkv, D, dtype):
    """a local workload: queries and keys carry their position on a circle, so far keys score low
    and far tiles get pruned (random inputs alone prune little)."""
    pos = np.arange(n) / n * 2 * np.pi
    enc = np.stack([np.cos(pos * f) for f in (1, 2, 3, 4)] + [np.sin(pos * f) for f in (1, 2, 3, 4)], 1)
    base = np.zeros((n, D))
    base[:, :8] = enc * 3.0
    mk = lambda h, f: rounded((base[:, None, :] + f * rng.standard_normal((n, h, D))).astype(np.float32), dtype)  # noqa: E731
    return mk(H, 0.3), mk(Hkv, 0.3), mk(Hkv, 1.0)


@pytest.mark.parametrize("dtype,shape", [("float16", dict(NW=4, MT=2, BN=32)),
                                         ("float16", dict(NW=4, MT=1, BN=64, a_smem=True, wgmma=True)),
                                         ("bfloat16", dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True)),
                                         ("float32", dict(NW=4, MT=1, BN=32, a_smem=True))])
@pytest.mark.parametrize("relname", ["causal_tail", "segments", "dense_rect_tail"])
@pytest.mark.parametrize("rho", [1e-3, 0.5])
def test_pruned_forward_matches_the_rule_tile_by_tile(dtype, shape, relname, rho):
    """the pruned forward (every engine: mma.sync, wgmma, 3xTF32) against the float64 replay of
    the admission rule with the kernel's tiles and order: the same tiles pruned (counts) and the
    output over the admitted entries; the counts are what explain() reports."""
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    rng = np.random.default_rng(int(rho * 1000) + len(relname))
    if relname == "dense_rect_tail":
        q, k, v, _ = _inputs(rng, dst[-1], src[-1], 2, 1, 64, dtype)
    else:
        q, k, v = _local_inputs(rng, dst[-1], 2, 1, 64, dtype)
    vr = G.Variant("fwd", 64, 64, dtype=dtype, prune=True, **shape).check()
    stats = {}
    o, _, _ = E.forward(vr, q, k, v, dst, src, causal.astype(np.uint8), 0.125, rho=rho, stats=stats)
    ro, pruned, visited = prune_oracle(q, k, v, dst, src, causal, 0.125, rho, vr.BM, vr.BN)
    assert (stats["pruned_tiles"], stats["total_tiles"]) == (pruned, visited)
    assert np.isfinite(o).all() and rel(o, ro) < 3 * TOL[dtype]


@pytest.mark.parametrize("causal", [1, 0])
def test_pruned_forward_prunes_a_local_workload(causal):
    """a longer local workload (512 tokens) does prune far tiles, causal and not, and still
    matches the replay tile by tile."""
    dst = src = np.array([0, 512])
    q, k, v = _local_inputs(np.random.default_rng(4), 512, 2, 1, 64, "float16")
    vr = G.Variant("fwd", 64, 64, NW=4, MT=1, BN=64, a_smem=True, wgmma=True, prune=True).check()
    stats = {}
    o, _, _ = E.forward(vr, q, k, v, dst, src, np.array([causal], np.uint8), 0.125, rho=0.05, stats=stats)
    ro, pruned, visited = prune_oracle(q, k, v, dst, src, [causal], 0.125, 0.05, vr.BM, vr.BN)
    assert (stats["pruned_tiles"], stats["total_tiles"]) == (pruned, visited) and pruned > 0
    assert rel(o, ro) < 3 * TOL["float16"]


def test_pruned_forward_with_a_tiny_threshold_is_exact():
    """rho -> 0 admits every tile: the pruned kernel then equals the exact oracle."""
    dst, src, causal = (np.array(x) for x in RELATIONS["segments"])
    q, k, v, _ = _inputs(np.random.default_rng(9), dst[-1], src[-1], 2, 2, 64, "float16")
    vr = G.Variant("fwd", 64, 64, NW=4, MT=1, BN=64, a_smem=True, wgmma=True, prune=True).check()
    stats = {}
    o, m, l = E.forward(vr, q, k, v, dst, src, causal.astype(np.uint8), 0.125, rho=1e-30, stats=stats)
    ro, rm, rl, *_ = oracle(q, k, v, q, dst, src, causal, 0.125)
    assert stats["pruned_tiles"] == 0 and stats["total_tiles"] > 0
    assert rel(o, ro) < TOL["float16"]


# ----------------------------------------------------------------------------- non-finite values
# Masked cells never multiply values (generator/guard.py): an inf / NaN in a key, value, query or
# output-gradient row outside a row's relation leaves that row bit-for-bit as without it (exact to
# the clean oracle), on the diagonal tiles of causal blocks and on the tails of every block (the
# neighbouring segment's rows sit right after the tile); inside a row's relation it reaches the row.
#: (relation, poisoned keys, poisoned query rows): key 100 / query 70 fall in the middle of a
#: diagonal tile; keys 39 and 97 end causal segments right before / after a non-causal one
NONFINITE_CASES = {"causal_tail": ([100], [70]), "segments": ([39, 97], [20, 60])}
NONFINITE_VARIANTS = {
    "f16": ("float16", dict(NW=4, MT=2, BN=64), dict(NW=4, MT=1, BN=64)),
    "bf16_as": ("bfloat16", dict(NW=4, MT=1, BN=32, a_smem=True), dict(NW=4, MT=1, BN=32, a_smem=True)),
    "f32_tf32": ("float32", dict(NW=8, MT=1, BN=64), dict(NW=4, MT=1, BN=32, a_smem=True)),
    "f16_prune": ("float16", dict(NW=4, MT=1, BN=64, prune=True), None),
    "f16_wgmma": ("float16", dict(NW=4, BN=64, **WG), dict(NW=4, BN=64, **WG)),
    "f32_wgmma_split": ("float32", dict(NW=4, BN=32, **WG), dict(NW=4, BN=32, **WG)),
}


def relation_mask(dst, src, causal):
    M = np.zeros((dst[-1], src[-1]), bool)
    for b in range(len(causal)):
        blk = np.ones((dst[b + 1] - dst[b], src[b + 1] - src[b]), bool)
        M[dst[b]:dst[b + 1], src[b]:src[b + 1]] = np.tril(blk) if causal[b] else blk
    return M


def _check_rows(got, want, clean, name):
    """rows `clean` equal the clean oracle (finite); every other row holds a non-finite value."""
    assert np.isfinite(got[clean]).all(), f"a non-finite value outside the relation reached {name}"
    assert rel(got[clean], want[clean]) < 3 * TOL[_check_rows.dtype], name
    assert (~np.isfinite(got[~clean])).reshape((~clean).sum(), -1).any(1).all(), \
        f"a non-finite value inside the relation did not reach {name}"


@pytest.mark.parametrize("relname", list(NONFINITE_CASES))
@pytest.mark.parametrize("name", list(NONFINITE_VARIANTS))
def test_nonfinite_outside_the_relation_never_reaches_a_row(monkeypatch, name, relname):
    """One kind of bad input at a time, so that each reaches the rows of its relation through the
    guard's poisoning alone where it is zeroed (the backward gets the clean out / m / l): NaN in V
    (out), inf in K (dq), inf in dO (dq, dk, dv), NaN in Q (dq, dk, dv)."""
    monkeypatch.setattr(E, "NAN_DATA", True)
    dtype, fshape, bshape = NONFINITE_VARIANTS[name]
    _check_rows.dtype = dtype
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    bad_keys, bad_rows = NONFINITE_CASES[relname]
    M = relation_mask(dst, src, causal)
    D, H, Hkv, scale = 64, 2, 1, 0.125
    q, k, v, do = _inputs(np.random.default_rng(5), dst[-1], src[-1], H, Hkv, D, dtype)
    ro, rm, rl, rdq, rdk, rdv = oracle(q, k, v, do, dst, src, causal, scale)
    c8 = causal.astype(np.uint8)
    vf = G.Variant("fwd", D, D, dtype=dtype, **fshape).check()
    vp = v.copy()
    vp[bad_keys] = np.nan
    o, m, l = E.forward(vf, q, k, vp, dst, src, c8, scale, rho=1e-30 if vf.prune else None)
    clean_rows = ~M[:, bad_keys].any(1)
    _check_rows(o, ro, clean_rows, "out")
    if bshape is None:
        return
    vq = G.Variant("dq", D, D, dtype=dtype, **bshape).check()
    vk = G.Variant("dkdv", D, D, dtype=dtype, **bshape).check()
    stats = (rounded(ro.astype(np.float32), dtype), rm.astype(np.float32), rl.astype(np.float32))
    kp = k.copy()
    kp[bad_keys] = np.inf
    dq, _, _ = E.backward(vq, vk, do, q, kp, v, *stats, dst, src, c8, scale)
    _check_rows(dq, rdq, clean_rows, "dq (inf in K)")
    clean_keys = ~M[bad_rows].any(0)
    clean_q = np.ones(len(q), bool)
    clean_q[bad_rows] = False
    for what, x in (("inf in dO", do), ("NaN in Q", q)):
        xp = x.copy()
        xp[bad_rows] = np.inf if x is do else np.nan
        args = (xp, q) if x is do else (do, xp)
        dq, dk, dv = E.backward(vq, vk, *args, k, v, *stats, dst, src, c8, scale)
        _check_rows(dq, rdq, clean_q, f"dq ({what})")
        _check_rows(dk, rdk, clean_keys, f"dk ({what})")
        _check_rows(dv, rdv, clean_keys, f"dv ({what})")


@pytest.mark.parametrize("name", ["f16", "f16_wgmma"])
def test_a_nan_score_makes_its_rows_and_their_gradient_shares_nan(monkeypatch, name):
    """A NaN in one key: every row that reads it is NaN (out and l), and the backward, given the
    forward's own stats, makes every gradient those rows contribute to NaN (dv of each key they
    read) instead of treating the NaN l as an empty row; rows and keys it does not reach stay
    finite."""
    monkeypatch.setattr(E, "NAN_DATA", True)
    dtype, fshape, bshape = NONFINITE_VARIANTS[name]
    dst, src, causal = (np.array(x) for x in RELATIONS["segments"])
    c8 = causal.astype(np.uint8)
    M = relation_mask(dst, src, causal)
    D, H, Hkv, scale = 64, 2, 1, 0.125
    q, k, v, do = _inputs(np.random.default_rng(7), dst[-1], src[-1], H, Hkv, D, dtype)
    k[60, 0, 3] = np.nan   # in the full block [40, 97): the others stay clean
    o, m, l = E.forward(G.Variant("fwd", D, D, dtype=dtype, **fshape).check(), q, k, v, dst, src, c8, scale)
    bad = M[:, 60]
    assert np.isnan(o[bad]).all() and np.isnan(l[bad]).all() and np.isfinite(o[~bad]).all()
    vq = G.Variant("dq", D, D, dtype=dtype, **bshape).check()
    vk = G.Variant("dkdv", D, D, dtype=dtype, **bshape).check()
    dq, dk, dv = E.backward(vq, vk, do, q, k, v, o, m, l, dst, src, c8, scale)
    reached = M[bad].any(0)
    for name_, g in (("dk", dk), ("dv", dv)):
        assert np.isnan(g[reached]).reshape(reached.sum(), -1).all(1).all(), f"{name_}: a NaN row's share was dropped"
        assert np.isfinite(g[~reached]).all() and (~reached).sum() > 30
    assert np.isnan(dq[bad]).reshape(bad.sum(), -1).all(1).all() and np.isfinite(dq[~bad]).all()


#: (dst_offsets, src_offsets, causal) of test_robustness's large-score relations (150 rows)
LARGE_RELATIONS = {"dense": ([0, 150], [0, 150], [0]), "triangular": ([0, 150], [0, 150], [1]),
                   "cu_seqlens": ([0, 1, 1, 70, 150], [0, 1, 1, 70, 150], [1, 1, 1, 1])}
#: shipped-like shapes of both engines: mma.sync (3xTF32 for float32) and wgmma (bf16 x 3)
LARGE_VARIANTS = {
    "mma": (dict(NW=4, MT=1, BN=32, a_smem=True), dict(NW=4, MT=1, BN=32, a_smem=True)),
    "wgmma": (dict(NW=4, BN=64, **WG), dict(NW=4, BN=32, **WG)),
}


@pytest.mark.parametrize("engine", list(LARGE_VARIANTS))
@pytest.mark.parametrize("kind", list(LARGE_RELATIONS))
@pytest.mark.parametrize("dtype, max_score", [("float32", 5e4), ("float32", 1e6), ("float32", 1e8),
                                              ("float16", 3e4)])
def test_backward_accurate_at_large_scores_emulated(engine, kind, dtype, max_score):
    """The forward's base-2 row max (m_kernel) carries into the Delta pre-pass unconverted, so
    the gradients keep a materialised float32 backward's accuracy at any finite score magnitude
    (test_robustness.check_large_scores, D = 64). Without it, m log2(e) rounded back from the
    natural-log m puts an ulp of m into every exponent: 2^16 at 1e8. The emulator contracts
    `a * sc - b` into one fma as the GPU compiler does: with m2 + log2 l added into one float32,
    or the dK/dV kernel's S^T summing its split parts in another order than the forward's S, the
    row's largest score would get another exponent than in the forward (2^(ulp(m2) / 2): 0.27%
    at 5e4)."""
    from test_robustness import EPS_3XTF32, _large_score_inputs, assert_large_score_accuracy
    np_dt = np.float16 if dtype == "float16" else np.float32
    _, mask, (q, k, v, do) = _large_score_inputs("dense", np_dt, max_score, d=64)
    dst, src, causal = (np.array(x) for x in LARGE_RELATIONS[kind])
    mask = np.zeros((150, 150), bool)
    for b in range(len(causal)):
        i0, i1, j0, j1 = dst[b], dst[b + 1], src[b], src[b + 1]
        blk = np.ones((i1 - i0, j1 - j0), bool)
        mask[i0:i1, j0:j1] = np.tril(blk) if causal[b] else blk
    scale = 0.3
    fwd, bwd = LARGE_VARIANTS[engine]
    vf = G.Variant("fwd", 64, 64, dtype=dtype, **fwd).check()
    vq = G.Variant("dq", 64, 64, dtype=dtype, **fwd).check()
    vk = G.Variant("dkdv", 64, 64, dtype=dtype, **bwd).check()
    stats = {}
    o, m, l = E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), scale, stats=stats)
    out = rounded(o, dtype)
    dq, dk, dv = E.backward(vq, vk, do, q, k, v, out, m, l, dst, src, causal.astype(np.uint8), scale,
                            m_kernel=stats["m_kernel"])
    assert_large_score_accuracy(q, k, v, do, mask, scale, out.astype(np_dt), m, dq, dk, dv,
                                eps=EPS_3XTF32 if engine == "mma" and dtype == "float32" else None)


_PROBE_CHECK = r"""
import sys, types
import numpy as np
sys.modules.setdefault("cupy", types.ModuleType("cupy"))   # the CUDA backend module imports cupy first
from tiga_numba.cuda import api as capi
from tiga_numba.cuda.tc import admission, device
import tiga_numba as tg
from tiga_numba.registry import Request
admission._device_can_run = lambda *a: True
device.use_wgmma = lambda dt: True


class Dev:
    def __init__(self, shape):
        self.shape, self.ndim, self.dtype = shape, len(shape), np.dtype(np.float16)
        self.__cuda_array_interface__ = dict(data=(1 << 20, False), shape=shape, strides=None,
                                             typestr=self.dtype.str, version=3)


class Graph:   # realize() without a device: the host relation
    realize = staticmethod(lambda dev: tg.Graph.triangular(10)._blocks)


for D, pruned, op, want in ((256, False, "forward", True), (256, True, "forward", False),
                            (256, False, "backward", True), (128, True, "forward", True),
                            (128, False, "backward", True)):
    check = capi.tensor_core_probe(Graph(), (Dev((10, 4, D)), Dev((10, 2, D)), Dev((10, 2, D))), 0.1, "dot")
    assert (check(Request(op=op, backend="cuda", pruned=pruned)) is None) == want, (D, pruned, op)
print("probe ok")
"""


def test_the_device_probe_passes_the_operation_and_pruning_to_admission():
    """cuda.api.tensor_core_probe hands supports() the request's operation and pruning (D = 256:
    plain calls, unpruned), in a process where cupy is a stand-in (no GPU here)."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", _PROBE_CHECK], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "probe ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("Dv", [32, 96, 128, 256])
def test_delta_prepass_reads_strided_rows_in_vectors(dtype, Dv):
    """The Delta pre-pass (16-byte loads by groups of lanes, G.delta_lanes) for every dtype and
    value width: Delta = sum_d dO O per (row, head) against float64 on the kernel's rounded inputs,
    the (m2, log2 l) pairs, (0, 0) for rows without edges, NaN log2 l where l is NaN. O and dO rows sit inside padded buffers
    whose padding is NaN (a read of it would show), and the (row, head) count leaves the last
    CTA partly idle."""
    rng = np.random.default_rng(Dv)
    nd, H = 37, 3
    pad = 16 // (4 if dtype == "float32" else 2)   # one 16-byte chunk: rows stay aligned
    item = 4 if dtype == "float32" else 2
    bufs, vals = [], []
    for _ in range(2):
        x = rng.standard_normal((nd, H + 1, Dv + pad)).astype(np.float32)
        x[:, H, :] = np.nan
        x[:, :, Dv:] = np.nan
        bufs.append(E.to_storage(x, dtype))
        vals.append(E.from_storage(bufs[-1], dtype)[:, :H, :Dv].astype(np.float64))
    m = (rng.standard_normal((nd, H)) * 30).astype(np.float32)
    l = rng.uniform(0.5, 200.0, (nd, H)).astype(np.float32)
    l[::5, 1] = 0.0
    l[3::7, 2] = np.nan   # a NaN or inf score in the row: stays NaN (NaN gradient shares)
    mem = E.Memory()
    ob, db = mem.put(bufs[0]), mem.put(bufs[1])
    mb, lb = mem.put(m), mem.put(l)
    dlt, lse = mem.alloc(nd * H * 4), mem.alloc(nd * H * 8)
    rs, hs = (H + 1) * (Dv + pad) * item, (Dv + pad) * item
    ctas, threads = G.delta_grid(dtype, Dv, nd * H)
    lanes = G.backward.delta_lanes(dtype, Dv)[0]
    assert ctas * threads // lanes > nd * H > (ctas - 1) * threads // lanes   # a partly idle last CTA
    E.launch(G.gen_delta(dtype, Dv), (ctas, 1), threads, 16, mem, dtype,
             (ob, db, mb, lb, dlt, lse, nd, H, rs, hs, rs, hs))
    delta = mem.get(dlt, np.float32, (nd, H))
    ref = np.einsum("ihd,ihd->ih", vals[0], vals[1])
    size = np.einsum("ihd,ihd->ih", np.abs(vals[0]), np.abs(vals[1]))
    assert np.all(np.abs(delta - ref) <= 1e-6 * size + 1e-30)
    pairs = mem.get(lse, np.float32, (nd, H, 2))
    empty = l == 0
    np.testing.assert_array_equal(pairs[..., 0], np.where(empty, 0.0, m))
    np.testing.assert_allclose(pairs[..., 1], np.where(empty, 0.0, np.log2(np.where(empty, 1.0, l))), rtol=1e-6)
    assert np.isnan(pairs[3::7, 2, 1]).all() and not np.isnan(np.delete(pairs[..., 1].ravel(), np.arange(3 * H + 2, nd * H, 7 * H))).any()
