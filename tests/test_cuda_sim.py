"""Simulator checks of the CUDA-core kernels (no GPU needed).

pytest runs each case in a subprocess with NUMBA_ENABLE_CUDASIM=1 (the variable must be set
before numba.cuda is imported); `NUMBA_ENABLE_CUDASIM=1 python tests/test_cuda_sim.py [case]`
runs them directly.

The kernels are launched as api.py launches them, with host arrays in place of device
pointers and one lane per row (G = 1: the simulator has no warp shuffles) and small tiles, so
every code path (several key tiles, tails, causal diagonal, empty segments, GQA, strided
inputs, pruning, edge bias, D = 0) runs on tiny shapes. Each result is compared with a
float64 oracle on fresh random inputs; outputs are poisoned with NaN first, so an unwritten
element fails.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shield():
    """numba-cuda's import redirector matches any module name containing "numba.cuda"."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "NumbaCudaFinder" and not getattr(finder, "_tiga_shielded", False):
            original = finder.find_spec

            def find_spec(name, path=None, target=None, _original=original):
                if name == "tiga_numba.cuda" or name.startswith("tiga_numba.cuda."):
                    return None
                return _original(name, path, target)
            finder.find_spec = find_spec
            finder._tiga_shielded = True


def _have_numba_cuda():
    try:
        import importlib.util
        return importlib.util.find_spec("numba_cuda") is not None
    except Exception:
        return False


SIM_CASES = ["blocks_f32_gqa_segments", "blocks_f64_dense_rect", "blocks_f16_mixed_strided",
             "prune", "csr_f32_bias_gqa", "csr_f64_nobias", "csr_edge_score_d0",
             "blocks_lane_groups", "blocks_banded_nan", "blocks_causal_nan", "nan_l_backward", "decode_split", "csr_split_hub",
             "large_scores", "large_scores_decode"]
# not met yet (case_large_scores_decode says why)
_XFAIL = {"large_scores_decode": "decode forward and blocks backward sum the score dot product in "
                                 "different orders: P off by e^(ulp of the score) at large scores"}


@pytest.mark.skipif(not _have_numba_cuda(), reason="numba-cuda is not installed")
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(reason=_XFAIL[c], strict=True))
                                  if c in _XFAIL else c for c in SIM_CASES])
def test_simulated_kernels(case):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), case], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def _install_sim_shuffles():
    """Block-synchronous shfl_xor_sync / syncwarp for the simulator: every thread of the CTA
    posts its value, waits at the block barrier, reads its xor partner's. Valid for kernels
    whose whole CTA executes every shuffle -- the block kernels (not the CSR ones). The kernel
    factories see the simulator offer the shuffles (launch.simulator_has) and compile their
    multi-lane paths for it."""
    import threading
    from numba.cuda.simulator import kernelapi

    def shfl_xor_sync(self, mask, value, lane_mask):
        th = threading.current_thread()
        box = th._manager.__dict__.setdefault("_tiga_shfl", {})
        box[th.thread_id] = value
        th.syncthreads()
        got = box[th.thread_id ^ lane_mask]
        th.syncthreads()
        return got

    def syncwarp(self, mask=0xFFFFFFFF):
        threading.current_thread().syncthreads()

    kernelapi.FakeCUDAModule.shfl_xor_sync = shfl_xor_sync
    kernelapi.FakeCUDAModule.syncwarp = syncwarp


def _kernels():
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
    _shield()
    sys.path.insert(0, ROOT)
    global blocks, csr, make_delta, make_stats, Tiles
    from tiga_numba.cuda import blocks, csr  # noqa: F401
    from tiga_numba.cuda.common import make_delta, make_stats  # noqa: F401
    from tiga_numba.cuda.tiles import Tiles  # noqa: F401
    _install_sim_shuffles()


RNG = np.random.default_rng(20261129)


# --------------------------------------------------------------------------- oracle
def band_of(dst_off, src_off, causal):
    """(lo, hi) of full / square-causal blocks, as BlockRelation defines them."""
    nd, ns = np.diff(dst_off), np.diff(src_off)
    return (1 - nd).astype(np.int64), np.where(causal != 0, 0, ns - 1).astype(np.int64)


def band_mask(dst_off, src_off, lo, hi, nq, ns):
    M = np.zeros((nq, ns), bool)
    for b in range(len(lo)):
        r = np.arange(dst_off[b + 1] - dst_off[b])[:, None]
        c = np.arange(src_off[b + 1] - src_off[b])[None, :]
        M[dst_off[b]:dst_off[b + 1], src_off[b]:src_off[b + 1]] = (c - r >= lo[b]) & (c - r <= hi[b])
    return M


def dense_mask(dst_off, src_off, causal, nq, ns):
    M = np.zeros((nq, ns), bool)
    for b in range(len(causal)):
        d0, d1, s0, s1 = dst_off[b], dst_off[b + 1], src_off[b], src_off[b + 1]
        if causal[b]:
            n = d1 - d0
            M[d0:d1, s0:s0 + n] = np.tril(np.ones((n, n), bool))
        else:
            M[d0:d1, s0:s1] = True
    return M


def oracle(q, k, v, M, scale, bias=None, dout=None):
    """float64 forward (+ backward when dout is given). bias: (nq, ns, H) dense or None."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    nq, H, D = q.shape
    ns, Hkv, DV = v.shape
    grp = H // Hkv
    out = np.zeros((nq, H, DV))
    m = np.full((nq, H), -np.inf)
    l = np.zeros((nq, H))
    P = np.zeros((H, nq, ns))
    for h in range(H):
        s = q[:, h] @ k[:, h // grp].T * scale
        if bias is not None:
            s = s + bias[:, :, h]
        s = np.where(M, s, -np.inf)
        mx = s.max(axis=1) if ns else np.full(nq, -np.inf)
        has = np.isfinite(mx)
        e = np.where(M, np.exp(s - np.where(has, mx, 0)[:, None]), 0.0)
        ls = e.sum(axis=1)
        p = np.where(has[:, None], e / np.where(ls > 0, ls, 1)[:, None], 0.0)
        P[h] = p
        out[:, h] = p @ v[:, h // grp]
        m[:, h] = mx
        l[:, h] = ls
    if dout is None:
        return out, m, l
    dout = dout.astype(np.float64)
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    dS_all = np.zeros((H, nq, ns))
    for h in range(H):
        hk = h // grp
        p = P[h]
        dv[:, hk] += p.T @ dout[:, h]
        dp = dout[:, h] @ v[:, hk].T
        delta = (dout[:, h] * out[:, h]).sum(axis=1)
        ds = p * (dp - delta[:, None])
        dS_all[h] = ds
        dq[:, h] = ds @ k[:, hk] * scale
        dk[:, hk] += ds.T @ q[:, h] * scale
    return out, m, l, dq, dk, dv, dS_all


def pruned_oracle(q, k, v, dst_off, src_off, causal, scale, BM, BN, rho):
    """float64 replay of the kernel's admission rule with the kernel's tiles and tile order
    (causal: diagonal tile first, then backwards; otherwise from the facing tile, wrapping)."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    nq, H, D = q.shape
    ns, Hkv, DV = v.shape
    grp = H // Hkv
    out = np.zeros((nq, H, DV))
    m_out = np.full((nq, H), -np.inf)
    l_out = np.zeros((nq, H))
    total = pruned = 0
    for h in range(H):
        for b in range(len(causal)):
            d0, d1, s0, s1 = dst_off[b], dst_off[b + 1], src_off[b], src_off[b + 1]
            for qt in range(d0, d1, BM):
                rows = np.arange(qt, min(qt + BM, d1))
                il = rows - d0
                kend = min(s1 - s0, qt - d0 + BM) if causal[b] else s1 - s0
                m = np.full(len(rows), -np.inf)
                l = np.zeros(len(rows))
                acc = np.zeros((len(rows), DV))
                ntl = -(-kend // BN)
                if causal[b]:
                    order = list(range(ntl - 1, -1, -1))  # diagonal tile first
                else:
                    t0 = min(ntl - 1, ((qt - d0 + BM // 2) * (s1 - s0) // max(d1 - d0, 1)) // BN)
                    order = [(t0 + i) % ntl for i in range(ntl)]
                for kt in (x * BN for x in order):
                    cols = np.arange(kt, min(kt + BN, kend))
                    s = q[rows, h] @ k[s0 + cols, h // grp].T * scale
                    if causal[b]:
                        s = np.where(cols[None, :] <= il[:, None], s, -np.inf)
                    tmax = s.max()
                    total += 1
                    if np.isfinite(m.max()) and tmax < m.max() + math.log(rho):
                        pruned += 1
                        continue
                    mn = np.maximum(m, s.max(axis=1))
                    alpha = np.where(np.isfinite(mn), np.exp(m - np.where(np.isfinite(mn), mn, 0)), 1.0)
                    p = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(mn), mn, 0)[:, None]), 0.0)
                    l = l * alpha + p.sum(axis=1)
                    acc = acc * alpha[:, None] + p @ v[s0 + cols, h // grp]
                    m = mn
                out[rows, h] = np.where(l[:, None] > 0, acc / np.where(l > 0, l, 1)[:, None], 0)
                m_out[rows, h] = m
                l_out[rows, h] = l
    return out, m_out, l_out, pruned, total


# --------------------------------------------------------------------------- launch utilities
def flat(x):
    item = x.dtype.itemsize
    return x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1), \
        [s // item for s in (x.strides if x.flags.c_contiguous else np.ascontiguousarray(x).strides)]


def strided(x):
    """A non-contiguous view with the same values (the kernels read any strides)."""
    big = np.empty(x.shape[:-1] + (x.shape[-1] + 3,), x.dtype)
    big[..., :x.shape[-1]] = x
    big[..., x.shape[-1]:] = np.nan
    view = big[..., :x.shape[-1]]
    return view


def base_and_strides(x):
    """The underlying flat buffer and element strides of a view of a contiguous base."""
    base = x.base if x.base is not None else x
    while base.base is not None:
        base = base.base
    item = x.dtype.itemsize
    off = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
    return base.reshape(-1)[off:], [s // item for s in x.strides]


def tiles(dtype, D, DV, R=2, NT=4, BN=4, G=1, VEC=1, UE=1):
    acc = "float64" if dtype == "float64" else "float32"
    return Tiles(dtype, acc, D, DV, G, R, NT, BN, VEC, UE=UE)


def nomod(acc):
    """The trailing modifier arguments of a kernel compiled without a modifier (never read)."""
    return (np.zeros(2, acc),) * 7


def _band_rel(rel):
    if len(rel) == 3:
        return tuple(rel) + band_of(*rel)
    return rel


def blocks_forward(q, k, v, rel, scale, dtype, prune=None, t=None, mod=None):
    """mod: a score modifier's launch state (test_cuda_sim_mods.SimModifier) or None."""
    dst_off, src_off, causal, lo, hi = _band_rel(rel)
    nq, H, D = q.shape
    Hkv, DV = k.shape[1], v.shape[2]
    t = t or tiles(dtype, D, DV)
    kern = blocks.make_forward(t, prune is not None, None if mod is None else mod.gen)
    acc = np.dtype(t.acc)
    out = np.full((nq, H, DV), np.nan, dtype)
    m = np.full((nq, H), np.nan, acc)
    l = np.full((nq, H), np.nan, acc)
    cnt = np.zeros(2, np.int64)
    qf, qs = base_and_strides(q)
    kf, ks = base_and_strides(k)
    vf, vs = base_and_strides(v)
    S = len(causal)
    maxd = int(np.diff(dst_off).max())
    tpb = -(-maxd // t.BM)
    kern((S * tpb, H, 1), (t.NT, 1, 1), None, qf, kf, vf, out.reshape(-1), m.reshape(-1),
         l.reshape(-1), dst_off, src_off, causal, lo, hi, cnt, *qs, *ks, *vs, tpb, H, H // Hkv,
         acc.type(scale), acc.type(math.log(prune) if prune else 0.0),
         *(nomod(acc) if mod is None else mod.forward_args()))
    return out, m, l, cnt


def blocks_backward(dout, q, k, v, out, m, l, rel, scale, dtype, lanes=None, mod=None):
    dst_off, src_off, causal, lo, hi = _band_rel(rel)
    nq, H, D = q.shape
    ns, Hkv, DV = v.shape
    tq = tiles(dtype, D, DV, R=2, NT=4, BN=4)
    tk = tiles(dtype, D, DV, R=1, NT=4, BN=4)
    if lanes is not None:  # (G, VEC): multi-lane groups, needs the emulated shuffles
        G, VEC = lanes
        tq = tiles(dtype, D, DV, R=2, NT=4 * G, BN=8, G=G, VEC=VEC)
        tk = tiles(dtype, D, DV, R=1, NT=4 * G, BN=8, G=G, VEC=VEC)
    acc = np.dtype(tq.acc)
    delta = np.full((nq, H), np.nan, acc)
    dkern = make_delta(dtype, tq.acc)
    df, ds = base_and_strides(dout)
    of, os_ = base_and_strides(out)
    dkern((-(-nq * H // dkern.rows_per_cta), 1, 1), (dkern.NT, 1, 1), None, df, of, delta.reshape(-1),
          *ds, *os_, nq * H, H, DV)
    qf, qs = base_and_strides(q)
    kf, ks = base_and_strides(k)
    vf, vs = base_and_strides(v)
    dq = np.full(q.shape, np.nan, dtype)
    dk = np.full(k.shape, np.nan, dtype)
    dv = np.full(v.shape, np.nan, dtype)
    S = len(causal)
    tpb = -(-int(np.diff(dst_off).max()) // tq.BM)
    gen = None if mod is None else mod.gen
    blocks.make_dq(tq, gen)((S * tpb, H, 1), (tq.NT, 1, 1), None, qf, kf, vf, df, m.reshape(-1),
                            l.reshape(-1), delta.reshape(-1), dq.reshape(-1), dst_off, src_off,
                            causal, lo, hi, *qs, *ks, *vs, *ds, tpb, H, H // Hkv, acc.type(scale),
                            *(nomod(acc) if mod is None else mod.dst_args()))
    tpbk = -(-int(np.diff(src_off).max()) // tk.BM)
    blocks.make_dkdv(tk, gen)((S * tpbk, Hkv, 1), (tk.NT, 1, 1), None, qf, kf, vf, df,
                              m.reshape(-1), l.reshape(-1), delta.reshape(-1), dk.reshape(-1),
                              dv.reshape(-1), dst_off, src_off, causal, lo, hi, *qs, *ks, *vs, *ds,
                              tpbk, H, H // Hkv, acc.type(scale),
                              *(nomod(acc) if mod is None else mod.src_args()))
    return dq, dk, dv, delta


def csr_forward(q, k, v, indptr, indices, bias, scale, dtype, piece=None, t=None, mod=None):
    """piece: cut rows longer than `piece` edges into pieces merged by make_softmax_merge."""
    nq, H, D = q.shape
    Hkv, DV = k.shape[1], v.shape[2]
    t = t or tiles(dtype, D, DV, R=1, NT=8)
    acc = np.dtype(t.acc)
    items = splits = None
    if piece is not None:
        items, splits, n_slots = csr.row_pieces(indptr, piece)
        assert splits.shape[0] > 0, "the test graph must have a row longer than a piece"
        pacc = np.full(n_slots * H * DV, np.nan, acc)
        pm = np.full(n_slots * H, np.nan, acc)
        pl = np.full(n_slots * H, np.nan, acc)
        tail = (items.reshape(-1), pacc, pm, pl)
    else:
        tail = (np.zeros(4, np.int64), np.zeros(2, acc), np.zeros(2, acc), np.zeros(2, acc))
    nrows = nq if items is None else items.shape[0]
    kern = csr.make_forward(t, bias is not None, items is not None, None if mod is None else mod.gen)
    out = np.full((nq, H, DV), np.nan, dtype)
    m = np.full((nq, H), np.nan, acc)
    l = np.full((nq, H), np.nan, acc)
    qf, qs = base_and_strides(q)
    kf, ks = base_and_strides(k)
    vf, vs = base_and_strides(v)
    b = bias.reshape(-1) if bias is not None else np.zeros(2, acc)
    kern((-(-nrows * H * t.G // t.NT), 1, 1), (t.NT, 1, 1), None, qf, kf, vf, out.reshape(-1),
         m.reshape(-1), l.reshape(-1), indptr, indices, b, *qs, *ks, *vs, nrows, H, H // Hkv,
         acc.type(scale), *tail, *(nomod(acc) if mod is None else mod.forward_args()))
    if items is not None:
        mk = csr.make_softmax_merge(dtype, t.acc, DV)
        mk((splits.shape[0] * H, 1, 1), (mk.NT, 1, 1), None, *tail[1:], splits.reshape(-1),
           out.reshape(-1), m.reshape(-1), l.reshape(-1), splits.shape[0], H)
    return out, m, l


def csr_backward(dout, q, k, v, out, m, l, indptr, indices, tptr, tind, perm, bias, scale, dtype,
                 piece=None, t=None, mod=None):
    nq, H, D = q.shape
    ns, Hkv, DV = v.shape
    t = t or tiles(dtype, D, DV, R=1, NT=8)
    acc = np.dtype(t.acc)
    st = np.full((nq, H, 3), np.nan, acc)
    skern = make_stats(dtype, t.acc)
    df, ds = base_and_strides(dout)
    of, os_ = base_and_strides(out)
    skern((-(-nq * H // skern.rows_per_cta), 1, 1), (skern.NT, 1, 1), None, df, of, m.reshape(-1),
          l.reshape(-1), st.reshape(-1), *ds, *os_, nq * H, H, DV)
    qf, qs = base_and_strides(q)
    kf, ks = base_and_strides(k)
    vf, vs = base_and_strides(v)
    dq = np.full(q.shape, np.nan, dtype)
    dk = np.full(k.shape, np.nan, dtype)
    dv = np.full(v.shape, np.nan, dtype)
    E = indices.shape[0]
    dbias = np.full((E, H), np.nan, acc) if bias is not None else np.zeros(2, acc)
    b = bias.reshape(-1) if bias is not None else np.zeros(2, acc)
    z8, za = np.zeros(4, np.int64), np.zeros(2, acc)
    qi = ki = None
    tq = tk = (z8, za, za, za)
    if piece is not None:
        qi, qsp, qslots = csr.row_pieces(indptr, piece)
        ki, ksp, kslots = csr.row_pieces(tptr, piece)
        assert qsp.shape[0] and ksp.shape[0], "the test graph must have long rows on both sides"
        pdq = np.full(qslots * H * D, np.nan, acc)
        pdk = np.full(kslots * Hkv * D, np.nan, acc)
        pdv = np.full(kslots * Hkv * DV, np.nan, acc)
        tq = (qi.reshape(-1), pdq, za, za)
        tk = (ki.reshape(-1), pdk, pdv, za)
    nqi = nq if qi is None else qi.shape[0]
    nki = ns if ki is None else ki.shape[0]
    gen = None if mod is None else mod.gen
    csr.make_dq(t, bias is not None, qi is not None, gen)(
        (-(-nqi * H * t.G // t.NT), 1, 1), (t.NT, 1, 1), None, qf, kf, vf, df, st.reshape(-1),
        dq.reshape(-1), dbias.reshape(-1), indptr, indices, b, *qs, *ks, *vs, *ds, nqi, H, H // Hkv,
        acc.type(scale), *tq,
        *(nomod(acc) if mod is None else mod.dst_args(None if qi is None else qslots)))
    csr.make_dkdv(t, bias is not None, ki is not None, gen, H // Hkv)(
        (-(-nki * Hkv * t.G // t.NT), 1, 1), (t.NT, 1, 1), None, qf, kf, vf, df, st.reshape(-1),
        dk.reshape(-1), dv.reshape(-1), tptr, tind, perm, b, *qs, *ks, *vs, *ds, nki, H, H // Hkv,
        acc.type(scale), *tk,
        *(nomod(acc) if mod is None else mod.src_args(None if ki is None else kslots)))
    if mod is not None and piece is not None:
        mod.merge(qsp, ksp)
    if piece is not None:
        for part, sp, dst, Hh, W, mult in ((pdq, qsp, dq, H, D, scale), (pdk, ksp, dk, Hkv, D, 1.0),
                                           (pdv, ksp, dv, Hkv, DV, 1.0)):
            mk = csr.make_sum_merge(dtype, t.acc, W)
            mk((sp.shape[0] * Hh, 1, 1), (mk.NT, 1, 1), None, part, sp.reshape(-1), dst.reshape(-1),
               sp.shape[0], Hh, acc.type(mult))
    return dq, dk, dv, (dbias if bias is not None else None)


# --------------------------------------------------------------------------- cases
def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert not np.isnan(a).any(), "NaN in kernel output (unwritten or bad)"
    den = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (den if den > 0 else 1.0)


def rand(*shape, dtype="float32"):
    return RNG.standard_normal(shape).astype(dtype)


def check(name, got, want, tol):
    e = rel_err(got, want)
    assert e <= tol, f"{name}: relative error {e:.3g} > {tol}"
    print(f"ok {name}: {e:.2e}")


def case_blocks(dtype="float32", H=2, Hkv=1, D=3, DV=5, layout=(("seg", 5, 5, 1), ("seg", 0, 0, 1),
                                                                    ("seg", 11, 11, 1), ("seg", 1, 1, 1)),
                strided_inputs=False, tol=2e-5):
    dst = [0]
    src = [0]
    causal = []
    for _, nd, ns, c in layout:
        dst.append(dst[-1] + nd)
        src.append(src[-1] + ns)
        causal.append(c)
    dst_off = np.array(dst, np.int64)
    src_off = np.array(src, np.int64)
    causal = np.array(causal, np.uint8)
    nq, ns = dst[-1], src[-1]
    q, k, v = rand(nq, H, D, dtype=dtype), rand(ns, Hkv, D, dtype=dtype), rand(ns, Hkv, DV, dtype=dtype)
    if strided_inputs:
        q, k, v = strided(q), strided(k), strided(v)
    scale = D ** -0.5 if D else 1.0
    M = dense_mask(dst_off, src_off, causal, nq, ns)
    dout = rand(nq, H, DV, dtype=dtype)
    ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, M, scale, dout=dout)
    rel = (dst_off, src_off, causal)
    out, m, l, _ = blocks_forward(q, k, v, rel, scale, dtype)
    tag = f"blocks {dtype} H={H}/{Hkv} D={D}/{DV} {'strided' if strided_inputs else ''}"
    check(tag + " out", out, ro, tol)
    fin = np.isfinite(rm)
    assert np.array_equal(np.isfinite(m), fin) and (l[~fin] == 0).all(), "empty rows: m=-inf, l=0"
    check(tag + " m", m[fin], rm[fin], tol)
    check(tag + " l", l, rl, tol)
    dq, dk, dv, _ = blocks_backward(dout, q, k, v, out, m, l, rel, scale, dtype)
    check(tag + " dq", dq, rdq, tol * 5)
    check(tag + " dk", dk, rdk, tol * 5)
    check(tag + " dv", dv, rdv, tol * 5)


def case_prune():
    """Keys 0..7 of each query tile are 'near' (large scores), the rest far below: with
    rho = 1e-2 the far tiles are provably pruned; with rho -> 0 the result is exact."""
    H, D, DV, n = 1, 4, 3, 16
    q = np.abs(rand(n, H, D)) + 1.0
    k = np.abs(rand(n, H, D))
    k[:4] += 6.0  # first key tile dominates every row
    v = rand(n, H, DV)
    scale = 1.0
    t = tiles("float32", D, DV)
    # causal, locality: s_ij = -(i - j)^2 / 2 (q_i = [i, 1, -i^2/2, 0], k_j = [j, -j^2/2, 1, 0]);
    # the diagonal tile is visited first and the far tiles fall below it
    pos = np.arange(n, dtype=np.float64)
    z = np.zeros(n)
    qc = np.stack([pos, np.ones(n), -pos ** 2 / 2, z], axis=1)[:, None, :].astype(np.float32)
    kc = np.stack([pos, -pos ** 2 / 2, np.ones(n), z], axis=1)[:, None, :].astype(np.float32)
    relc = (np.array([0, n], np.int64), np.array([0, n], np.int64), np.array([1], np.uint8))
    out, m, l, cnt = blocks_forward(qc, kc, v, relc, scale, "float32", prune=1e-2, t=t)
    ro, rm, rl, pruned, total = pruned_oracle(qc, kc, v, *relc, scale, t.BM, t.BN, 1e-2)
    assert (int(cnt[0]), int(cnt[1])) == (pruned, total), (cnt, pruned, total)
    check(f"prune causal ({pruned}/{total} tiles pruned) out", out, ro, 2e-5)
    assert pruned > 0
    rel = (np.array([0, n], np.int64), np.array([0, n], np.int64), np.array([0], np.uint8))
    for rho in (1e-2, 1e-30):
        out, m, l, cnt = blocks_forward(q, k, v, rel, scale, "float32", prune=rho, t=t)
        ro, rm, rl, pruned, total = pruned_oracle(q, k, v, *rel, scale, t.BM, t.BN, rho)
        assert (int(cnt[0]), int(cnt[1])) == (pruned, total), (cnt, pruned, total)
        check(f"prune rho={rho:g} ({pruned}/{total} tiles pruned) out", out, ro, 2e-5)
        check(f"prune rho={rho:g} l", l, rl, 2e-5)
        if rho == 1e-2:
            assert pruned > 0, "the far tiles must be pruned"
        else:
            assert pruned == 0
            M = np.ones((n, n), bool)
            check("prune rho->0 equals exact", out, oracle(q, k, v, M, scale)[0], 2e-5)


def case_csr(dtype="float32", H=2, Hkv=1, D=3, DV=4, with_bias=True, tol=2e-5):
    nq, ns = 9, 7
    deg = RNG.integers(0, 8, nq)  # up to 7: several steps of 1 and 3 edges and every tail length
    deg[2] = 0  # an empty row
    deg[5] = 1
    indptr = np.zeros(nq + 1, np.int64)
    np.cumsum(deg, out=indptr[1:])
    indices = np.concatenate([np.sort(RNG.choice(ns, d, replace=False)) for d in deg]).astype(np.int32)
    E = indices.shape[0]
    rows = np.repeat(np.arange(nq), deg)
    perm = np.argsort(indices, kind="stable").astype(np.int64)
    tptr = np.zeros(ns + 1, np.int64)
    np.cumsum(np.bincount(indices, minlength=ns), out=tptr[1:])
    tind = rows[perm].astype(np.int32)
    q, k, v = rand(nq, H, D, dtype=dtype), rand(ns, Hkv, D, dtype=dtype), rand(ns, Hkv, DV, dtype=dtype)
    acc = "float64" if dtype == "float64" else "float32"
    bias = rand(E, H, dtype=acc) if with_bias else None
    M = np.zeros((nq, ns), bool)
    M[rows, indices] = True
    dense_bias = None
    if with_bias:
        dense_bias = np.zeros((nq, ns, H))
        dense_bias[rows, indices] = bias
    scale = D ** -0.5 if D else 1.0
    dout = rand(nq, H, DV, dtype=dtype)
    ro, rm, rl, rdq, rdk, rdv, dS = oracle(q, k, v, M, scale, dense_bias, dout)
    tag = f"csr {dtype} H={H}/{Hkv} D={D}/{DV} bias={with_bias}"
    out, m, l = csr_forward(q, k, v, indptr, indices, bias, scale, dtype)
    check(tag + " out", out, ro, tol)
    fin = np.isfinite(rm)
    assert np.array_equal(np.isfinite(m), fin) and (l[~fin] == 0).all()
    check(tag + " l", l, rl, tol)
    # three edges per step: rows whose length is not a multiple of the step end in a partial one
    out3, m3, l3 = csr_forward(q, k, v, indptr, indices, bias, scale, dtype,
                               t=tiles(dtype, D, DV, R=1, NT=8, UE=3))
    check(tag + " out (3 edges per step)", out3, ro, tol)
    assert np.array_equal(np.isfinite(m3), fin) and (l3[~fin] == 0).all()
    check(tag + " l (3 edges per step)", l3, rl, tol)
    dq, dk, dv, dbias = csr_backward(dout, q, k, v, out, m, l, indptr, indices, tptr, tind, perm,
                                     bias, scale, dtype)
    if D:
        check(tag + " dq", dq, rdq, tol * 5)
        check(tag + " dk", dk, rdk, tol * 5)
    check(tag + " dv", dv, rdv, tol * 5)
    if with_bias:
        check(tag + " dbias", dbias, dS.transpose(1, 2, 0)[rows, indices], tol * 5)


def case_lane_groups():
    """G = 4 lanes per row with 16-byte slices (VEC = 4): the GPU layout, the reduce-scatter
    of scores (D = 16) and the per-key shuffle path (D = 72: loop too large for it), forward
    and backward, causal segments with GQA, through the emulated shuffles."""
    dst_off = np.array([0, 5, 5, 13], np.int64)
    causal = np.array([1, 1, 0], np.uint8)
    src_off = np.array([0, 5, 5, 17], np.int64)  # 12 keys of the last block: two key tiles
    rel = (dst_off, src_off, causal)
    nq, ns, H, Hkv = 13, 17, 2, 1
    M = dense_mask(dst_off, src_off, causal, nq, ns)
    for D, DV, R in ((16, 12, 2), (72, 20, 4)):
        q, k, v = rand(nq, H, D), rand(ns, Hkv, D), rand(ns, Hkv, DV)
        dout = rand(nq, H, DV)
        scale = D ** -0.5
        ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, M, scale, dout=dout)
        t = tiles("float32", D, DV, R=R, NT=16, BN=8, G=4, VEC=4)
        out, m, l, _ = blocks_forward(q, k, v, rel, scale, "float32", t=t)
        tag = f"lane groups G=4 VEC=4 D={D}/{DV} R={R}"
        check(tag + " out", out, ro, 2e-5)
        check(tag + " l", l, rl, 2e-5)
        dq, dk, dv, _ = blocks_backward(dout, q, k, v, out, m, l, rel, scale, "float32", lanes=(4, 4))
        check(tag + " dq", dq, rdq, 1e-4)
        check(tag + " dk", dk, rdk, 1e-4)
        check(tag + " dv", dv, rdv, 1e-4)


def case_banded_nan():
    """Banded blocks (bottom-right causal with Lq < Lk and Lq > Lk, sliding windows, an empty
    band, a rectangular band leaving keys unreachable and rows empty) against the oracle, then
    NaN / inf put in every k, v row no destination reaches and in the q, dout rows of empty
    destinations: every output must stay finite and equal the clean result."""
    blocks_ = [(5, 9, -4, 4), (9, 5, -8, -4), (12, 12, -3, 0), (7, 7, 0, -1), (0, 3, 0, -1),
               (6, 13, -2, 3), (13, 6, -3, 0), (1, 1, 0, 0)]
    nd = np.array([b[0] for b in blocks_])
    ns = np.array([b[1] for b in blocks_])
    dst_off = np.concatenate([[0], np.cumsum(nd)]).astype(np.int64)
    src_off = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    lo = np.array([b[2] for b in blocks_], np.int64)
    hi = np.array([b[3] for b in blocks_], np.int64)
    causal = np.zeros(len(blocks_), np.uint8)
    causal[2] = 0  # hi = 0 with a lower bound: a window, not the causal flag
    rel = (dst_off, src_off, causal, lo, hi)
    nq, nk = int(dst_off[-1]), int(src_off[-1])
    M = band_mask(dst_off, src_off, lo, hi, nq, nk)
    H, Hkv = 2, 1
    for D, DV, lanes in ((3, 5, None), (16, 12, (4, 4))):
        q, k, v = rand(nq, H, D), rand(nk, Hkv, D), rand(nk, Hkv, DV)
        dout = rand(nq, H, DV)
        scale = D ** -0.5
        ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, M, scale, dout=dout)
        t = None if lanes is None else tiles("float32", D, DV, R=2, NT=16, BN=8, G=4, VEC=4)
        tag = f"banded D={D}/{DV} lanes={lanes}"
        out, m, l, _ = blocks_forward(q, k, v, rel, scale, "float32", t=t)
        check(tag + " out", out, ro, 2e-5)
        check(tag + " l", l, rl, 2e-5)
        dq, dk, dv, _ = blocks_backward(dout, q, k, v, out, m, l, rel, scale, "float32", lanes=lanes)
        check(tag + " dq", dq, rdq, 1e-4)
        check(tag + " dk", dk, rdk, 1e-4)
        check(tag + " dv", dv, rdv, 1e-4)
        dead_keys = ~M.any(axis=0)
        dead_rows = ~M.any(axis=1)
        assert dead_keys.sum() >= 7 and dead_rows.sum() >= 7
        kp, vp, qp, dp = k.copy(), v.copy(), q.copy(), dout.copy()
        kp[dead_keys] = np.nan
        vp[dead_keys] = np.inf
        vp[np.flatnonzero(dead_keys)[::2]] = np.nan
        qp[dead_rows] = np.nan
        dp[dead_rows] = np.inf
        out2, m2, l2, _ = blocks_forward(qp, kp, vp, rel, scale, "float32", t=t)
        assert np.isfinite(out2).all(), tag + ": non-finite value outside the band reached out"
        check(tag + " out with NaN outside the band", out2, ro, 2e-5)
        dq2, dk2, dv2, _ = blocks_backward(dp, qp, kp, vp, out2, m2, l2, rel, scale, "float32",
                                           lanes=lanes)
        for name, got, want in (("dq", dq2, rdq), ("dk", dk2[~dead_keys], rdk[~dead_keys]),
                                ("dv", dv2[~dead_keys], rdv[~dead_keys])):
            assert np.isfinite(got).all(), f"{tag}: non-finite value outside the band reached {name}"
            check(f"{tag} {name} with NaN outside the band", got, want, 1e-4)
        assert (dk2[dead_keys] == 0).all() and (dv2[dead_keys] == 0).all()


def case_causal_nan():
    """NaN / inf inside a causal block, in the middle of a key tile the diagonal cuts: v[j] = NaN,
    k[j] = inf leave rows i < j of the block equal to the clean oracle (out, dq), q[i] = NaN,
    dout[i] = inf leave keys j > i equal to it (dk, dv); the rows that reach a bad row get a
    non-finite value. One lane per row and 4-lane groups (the reduce-scatter and per-key paths)."""
    dst_off = np.array([0, 3, 16], np.int64)   # a short block before: the bad rows are not its own
    src_off = dst_off.copy()
    causal = np.array([1, 1], np.uint8)
    rel = (dst_off, src_off, causal)
    n, H, Hkv = 16, 2, 1
    M = dense_mask(dst_off, src_off, causal, n, n)
    bad_key, bad_row = 9, 6   # block-local 6 and 3: inside key tiles of 4 and 8
    for D, DV, lanes in ((3, 5, None), (16, 12, (4, 4))):
        q, k, v, dout = rand(n, H, D), rand(n, Hkv, D), rand(n, Hkv, DV), rand(n, H, DV)
        scale = D ** -0.5
        ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, M, scale, dout=dout)
        t = None if lanes is None else tiles("float32", D, DV, R=2, NT=16, BN=8, G=4, VEC=4)
        tag = f"causal NaN D={D}/{DV} lanes={lanes}"
        kp, vp = k.copy(), v.copy()
        kp[bad_key] = np.inf
        vp[bad_key] = np.nan
        out, m, l, _ = blocks_forward(q, kp, vp, rel, scale, "float32", t=t)
        clean = ~M[:, bad_key]
        assert np.isfinite(out[clean]).all(), tag + ": v / k of a later key reached out"
        assert (~np.isfinite(out[~clean])).any(axis=(1, 2)).all(), tag + ": a bad key in the relation was cleaned"
        check(tag + " out (bad key)", out[clean], ro[clean], 2e-5)
        dq, _, _, _ = blocks_backward(dout, q, kp, vp, out, m, l, rel, scale, "float32", lanes=lanes)
        assert np.isfinite(dq[clean]).all(), tag + ": v / k of a later key reached dq"
        check(tag + " dq (bad key)", dq[clean], rdq[clean], 1e-4)
        qp, dp = q.copy(), dout.copy()
        qp[bad_row] = np.nan
        dp[bad_row] = np.inf
        out, m, l, _ = blocks_forward(qp, k, v, rel, scale, "float32", t=t)
        dq, dk, dv, _ = blocks_backward(dp, qp, k, v, out, m, l, rel, scale, "float32", lanes=lanes)
        ck = ~M[bad_row]
        for name, got, want in (("dk", dk, rdk), ("dv", dv, rdv)):
            assert np.isfinite(got[ck]).all(), f"{tag}: q / dout of an earlier row reached {name}"
            assert (~np.isfinite(got[~ck])).any(axis=(1, 2)).all(), f"{tag}: {name} cleaned a bad row"
            check(f"{tag} {name} (bad row)", got[ck], want[ck], 1e-4)
        cq = np.arange(n) != bad_row
        assert np.isfinite(dq[cq]).all()
        check(f"{tag} dq (bad row)", dq[cq], rdq[cq], 1e-4)


def case_nan_l_backward():
    """A NaN key makes the forward's l NaN for every row that reads it: those rows' probabilities
    are NaN, and so is every gradient they contribute to (dq of the row, dk / dv of each key it
    reads), as on the CPU, never a finite value missing the row's share; rows and keys it does not
    reach equal the float64 oracle. Block kernels (a dense block holding the NaN key beside a
    clean rectangular one) and the CSR kernels (rows 0 <- {0, 1} and 1 <- {1, 2}, key 0 NaN)."""
    H, Hkv, D, DV = 2, 1, 3, 4
    dst_off = np.array([0, 5, 11], np.int64)
    src_off = np.array([0, 5, 12], np.int64)
    rel = (dst_off, src_off, np.array([0, 0], np.uint8))
    n, ns = 11, 12
    M = dense_mask(dst_off, src_off, np.array([0, 0], np.uint8), n, ns)
    q, k, v, dout = rand(n, H, D), rand(ns, Hkv, D), rand(ns, Hkv, DV), rand(n, H, DV)
    scale = D ** -0.5
    _, _, _, rdq, rdk, rdv, _ = oracle(q, k, v, M, scale, dout=dout)
    k[1, 0, 0] = np.nan
    out, m, l, _ = blocks_forward(q, k, v, rel, scale, "float32")
    assert np.isnan(l[:5]).all() and np.isfinite(l[5:]).all()
    dq, dk, dv, _ = blocks_backward(dout, q, k, v, out, m, l, rel, scale, "float32")
    for name, got in (("dq", dq[:5]), ("dk", dk[:5]), ("dv", dv[:5])):
        assert np.isnan(got).all(), f"blocks NaN l: {name} of the NaN block has a finite value"
    for name, got, want in (("dq", dq[5:], rdq[5:]), ("dk", dk[5:], rdk[5:]), ("dv", dv[5:], rdv[5:])):
        check("blocks NaN l, clean block " + name, got, want, 1e-4)

    indptr = np.array([0, 2, 4], np.int64)
    indices = np.array([0, 1, 1, 2], np.int32)
    rows = np.array([0, 0, 1, 1])
    perm = np.argsort(indices, kind="stable").astype(np.int64)
    tptr = np.array([0, 1, 3, 4], np.int64)
    tind = rows[perm].astype(np.int32)
    q, k, v, dout = rand(2, H, D), rand(3, Hkv, D), rand(3, Hkv, DV), rand(2, H, DV)
    Mc = np.zeros((2, 3), bool)
    Mc[rows, indices] = True
    _, _, _, rdq, rdk, rdv, _ = oracle(q, k, v, Mc[[1, 1]] & (np.arange(2) == 1)[:, None], scale, dout=dout)
    k[0, 0, 1] = np.nan
    out, m, l = csr_forward(q, k, v, indptr, indices, None, scale, "float32")
    assert np.isnan(l[0]).all() and np.isfinite(l[1]).all()
    dq, dk, dv, _ = csr_backward(dout, q, k, v, out, m, l, indptr, indices, tptr, tind, perm, None,
                                 scale, "float32")
    assert np.isnan(dq[0]).all() and np.isnan(dk[:2]).all() and np.isnan(dv[:2]).all(), \
        "CSR NaN l: a gradient share of the NaN row came back finite"
    # key 2 is read by row 1 only: its gradients are row 1's alone (the oracle over row 1's edges)
    check("csr NaN l, dq of the clean row", dq[1], rdq[1], 1e-4)
    check("csr NaN l, dk of the key only the clean row reads", dk[2], rdk[2], 1e-4)
    check("csr NaN l, dv of the key only the clean row reads", dv[2], rdv[2], 1e-4)

    # the forward's partial states: a NaN score alone in a piece of a split row (the piece's m stays
    # -inf, its l is NaN) and first in the decode kernel's key chunks; every split count
    indptr = np.array([0, 4, 6], np.int64)
    indices = np.array([0, 1, 2, 3, 2, 3], np.int32)
    q, k, v = rand(2, H, D), rand(4, Hkv, D), rand(4, Hkv, DV)
    k[0, 0, 0] = np.nan
    for piece in (None, 1, 2):
        out, m, l = csr_forward(q, k, v, indptr, indices, None, scale, "float32", piece=piece)
        assert np.isnan(out[0]).all() and np.isnan(l[0]).all(), f"CSR piece={piece}: the NaN row came back finite"
        assert np.isfinite(out[1]).all() and np.isfinite(l[1]).all()
    from tiga_numba.cuda.decode import DecodeTiles
    rel = (np.array([0, 1, 2], np.int64), np.array([0, 9, 14], np.int64), np.zeros(2, np.uint8),
           np.array([-(1 << 40)] * 2, np.int64), np.array([1 << 40] * 2, np.int64))
    M = band_mask(*rel[:2], rel[3], rel[4], 2, 14)
    q, k, v = rand(2, H, D), rand(14, Hkv, D), rand(14, Hkv, DV)
    ro, _, _ = oracle(q, k, v, M, scale)
    k[0, 0, 2] = np.nan   # the first key of the first sequence
    t = DecodeTiles("float32", "float32", D, DV, G=1, T=2, NW=1, ROWS=4, threads=2)
    for splits, chunk in ((1, 64), (3, 4), (5, 2)):
        out, m, l = decode_forward(q, k, v, rel, scale, "float32", t, splits, chunk)
        assert np.isnan(out[0]).all() and np.isnan(l[0]).all(), f"decode splits={splits}: the NaN row came back finite"
        check(f"decode splits={splits}, the clean sequence", out[1], ro[1], 2e-5)


def decode_forward(q, k, v, rel, scale, dtype, t, splits, chunk):
    """The split-key kernel (+ merge when splits > 1), launched as api.py launches it."""
    from tiga_numba.cuda import decode
    dst_off, src_off, causal, lo, hi = rel
    nq, H, D = q.shape
    Hkv, DV = k.shape[1], v.shape[2]
    grp = H // Hkv
    acc = np.dtype(t.acc)
    nrg = max(1, -(-int(np.diff(dst_off).max()) * grp // t.ROWS))
    out = np.full((nq, H, DV), np.nan, dtype)
    m = np.full((nq, H), np.nan, acc)
    l = np.full((nq, H), np.nan, acc)
    pacc = np.full(nq * H * splits * DV, np.nan, acc)
    pm = np.full(nq * H * splits, np.nan, acc)
    pl = np.full(nq * H * splits, np.nan, acc)
    qf, qs = base_and_strides(q)
    kf, ks = base_and_strides(k)
    vf, vs = base_and_strides(v)
    kern = decode.make_decode(t)
    kern((len(lo), splits, Hkv * nrg), (t.NT, 1, 1), None, qf, kf, vf, out.reshape(-1), m.reshape(-1),
         l.reshape(-1), pacc, pm, pl, dst_off, src_off, lo, hi, *qs, *ks, *vs, H, grp, nrg, splits,
         chunk, acc.type(scale))
    if splits > 1:
        mk = decode.make_merge(dtype, t.acc, DV)
        mk((nq * H, 1, 1), (mk.NT, 1, 1), None, pacc, pm, pl, np.zeros(3, np.int64), out.reshape(-1),
           m.reshape(-1), l.reshape(-1), nq * H, splits)
    return out, m, l


def case_decode_split():
    """Split-key decode kernel: 1-3 query rows per block over long key ranges, GQA packing
    (2 query heads per kv head), a bottom-right causal band, an empty block, splits from 1 to
    several (partials merged), every tail; then NaN / inf in k, v rows no row reaches."""
    from tiga_numba.cuda.decode import DecodeTiles
    blocks_ = [(1, 21, 0, 20), (2, 17, -1, 15), (3, 12, -2, 9), (1, 0, 0, -1), (2, 9, -1, 8),
               (1, 23, 0, 11)]
    nd = np.array([b[0] for b in blocks_])
    ns = np.array([b[1] for b in blocks_])
    dst_off = np.concatenate([[0], np.cumsum(nd)]).astype(np.int64)
    src_off = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    lo = np.array([b[2] for b in blocks_], np.int64)
    hi = np.array([b[3] for b in blocks_], np.int64)
    rel = (dst_off, src_off, np.zeros(len(lo), np.uint8), lo, hi)
    nq, nk = int(dst_off[-1]), int(src_off[-1])
    M = band_mask(dst_off, src_off, lo, hi, nq, nk)
    H, Hkv = 2, 1  # two query heads per kv head (one kv head: half the simulated CTAs)
    for dtype, D, DV, G, tol in (("float32", 8, 6, 4, 2e-5), ("float64", 5, 3, 1, 1e-12),
                                 ("float16", 8, 8, 2, 2e-3)):
        q, k, v = rand(nq, H, D, dtype=dtype), rand(nk, Hkv, D, dtype=dtype), rand(nk, Hkv, DV, dtype=dtype)
        scale = D ** -0.5
        ro, rm, rl = oracle(q, k, v, M, scale)
        acc = "float64" if dtype == "float64" else "float32"
        t = DecodeTiles(dtype, acc, D, DV, G=G, T=2, NW=1, ROWS=4, threads=2 * G)
        # every split count for float32 (with (3, 8) the longest block's last chunk holds keys);
        # the split logic is the same code for the others
        for splits, chunk in ((1, 64), (3, 16), (10, t.step), (3, 8)) if dtype == "float32" else ((3, 16), (3, 8)):
            tag = f"decode {dtype} D={D}/{DV} G={G} splits={splits}"
            out, m, l = decode_forward(q, k, v, rel, scale, dtype, t, splits, chunk)
            check(tag + " out", out, ro, tol)
            fin = np.isfinite(rm)
            assert np.array_equal(np.isfinite(m), fin) and (l[~fin] == 0).all()
            check(tag + " m", m[fin], rm[fin], tol)
            check(tag + " l", l, rl, tol)
        dead = ~M.any(axis=0)
        assert dead.sum() >= 11
        kp, vp = k.copy(), v.copy()
        kp[dead] = np.nan
        vp[dead] = np.inf
        out2, _, _ = decode_forward(q, kp, vp, rel, scale, dtype, t, 3, 16)
        assert np.isfinite(out2).all(), "non-finite k / v outside the band reached a row"
        check(f"decode {dtype} with NaN outside the band", out2, ro, tol)


def case_csr_split_hub():
    """Split rows: one destination holding most of the edges and one source read by every
    destination (the transposed pass's hub), cut into pieces merged in fixed order, forward,
    dq, dk/dv and dbias, against the float64 oracle; the split result equals the unsplit one
    within rounding and repeats bit for bit."""
    nq, ns, H, Hkv, D, DV = 9, 12, 2, 1, 3, 4
    rows, cols = [], []
    for i in range(nq):
        if i == 4:
            cs = np.arange(ns)  # hub destination: every source
        elif i == 2:
            cs = np.array([], np.int64)
        else:
            cs = np.unique(np.concatenate([[0], RNG.choice(ns, 2, replace=False)]))  # source 0: every row
        rows += [i] * len(cs)
        cols += list(cs)
    rows, cols = np.array(rows), np.array(cols)
    deg = np.bincount(rows, minlength=nq)
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    indices = cols.astype(np.int32)
    perm = np.argsort(indices, kind="stable").astype(np.int64)
    tptr = np.concatenate([[0], np.cumsum(np.bincount(indices, minlength=ns))]).astype(np.int64)
    tind = rows[perm].astype(np.int32)
    q, k, v = rand(nq, H, D), rand(ns, Hkv, D), rand(ns, Hkv, DV)
    E = indices.shape[0]
    bias = rand(E, H)
    M = np.zeros((nq, ns), bool)
    M[rows, indices] = True
    dense_bias = np.zeros((nq, ns, H))
    dense_bias[rows, indices] = bias
    scale = D ** -0.5
    dout = rand(nq, H, DV)
    ro, rm, rl, rdq, rdk, rdv, dS = oracle(q, k, v, M, scale, dense_bias, dout)
    t = tiles("float32", D, DV, R=1, NT=8)
    base = csr_forward(q, k, v, indptr, indices, bias, scale, "float32")
    for piece in (3, 5):
        tag = f"csr split piece={piece}"
        out, m, l = csr_forward(q, k, v, indptr, indices, bias, scale, "float32", piece=piece, t=t)
        check(tag + " out", out, ro, 2e-5)
        check(tag + " l", l, rl, 2e-5)
        check(tag + " out vs unsplit", out, base[0], 2e-6)
        again = csr_forward(q, k, v, indptr, indices, bias, scale, "float32", piece=piece, t=t)
        assert np.array_equal(out, again[0]) and np.array_equal(m, again[1]), "split not repeatable"
        dq, dk, dv, dbias = csr_backward(dout, q, k, v, out, m, l, indptr, indices, tptr, tind, perm,
                                         bias, scale, "float32", piece=piece, t=t)
        check(tag + " dq", dq, rdq, 1e-4)
        check(tag + " dk", dk, rdk, 1e-4)
        check(tag + " dv", dv, rdv, 1e-4)
        check(tag + " dbias", dbias, dS.transpose(1, 2, 0)[rows, indices], 1e-4)


def _large_inputs(M, H, Hkv, D, dtype, max_score, scale, seed):
    """q, k, v, dout whose largest |score| over the mask M is max_score (test_robustness)."""
    r = np.random.default_rng(seed)
    nq, ns = M.shape
    q, k = r.standard_normal((nq, H, D)), r.standard_normal((ns, Hkv, D))
    raw = np.abs(np.einsum("ihd,jhd->hij", q, np.repeat(k, H // Hkv, 1)) * scale)
    amp = np.sqrt(max_score / raw[:, M].max())
    v, dout = r.standard_normal((ns, Hkv, D)), r.standard_normal((nq, H, D))
    return [x.astype(dtype) for x in (q * amp, k * amp, v, dout)]


def case_large_scores():
    """CUDA-core kernels at large scores (float32 max score 1e6 and 1e8, float16 3e4): m is the
    natural-log row max exactly as the forward found it, and the backward recomputes the scores
    in the same units, so the gradients keep a materialised float32 backward's accuracy
    (test_robustness.assert_large_score_accuracy): blocks (dense and causal segments), CSR with
    exact ties and split rows (the softmax merge)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_robustness import assert_large_score_accuracy
    H, Hkv, D, scale = 2, 1, 4, 0.3
    for dtype, mx in (("float32", 1e6), ("float32", 1e8), ("float16", 3e4)):
        seed = int(np.log10(mx))
        # blocks: a dense 12 x 12 block and a causal 8 x 8 one
        dst_off = np.array([0, 12, 20], np.int64)
        causal = np.array([0, 1], np.uint8)
        M = dense_mask(dst_off, dst_off, causal, 20, 20)
        q, k, v, dout = _large_inputs(M, H, Hkv, D, dtype, mx, scale, seed)
        out, m, l, _ = blocks_forward(q, k, v, (dst_off, dst_off, causal), scale, dtype)
        dq, dk, dv, _ = blocks_backward(dout, q, k, v, out, m, l, (dst_off, dst_off, causal), scale, dtype)
        assert_large_score_accuracy(q, k, v, dout, M, scale, out, m, dq, dk, dv)
        # CSR: a hub row cut into pieces, and keys 6..11 copies of 0..5 (exact ties, l = 2)
        nq = ns = 12
        M = RNG.random((nq, ns)) < 0.4
        M[4] = True
        M[2] = False
        rows, cols = np.nonzero(M)
        indptr = np.concatenate([[0], np.cumsum(M.sum(1))]).astype(np.int64)
        indices = cols.astype(np.int32)
        perm = np.argsort(indices, kind="stable").astype(np.int64)
        tptr = np.concatenate([[0], np.cumsum(np.bincount(indices, minlength=ns))]).astype(np.int64)
        tind = rows[perm].astype(np.int32)
        q, k, v, dout = _large_inputs(M, H, Hkv, D, dtype, mx, scale, seed + 1)
        k[6:12] = k[0:6]
        t = tiles(dtype, D, D, R=1, NT=8)
        out, m, l = csr_forward(q, k, v, indptr, indices, None, scale, dtype, piece=3, t=t)
        dq, dk, dv, _ = csr_backward(dout, q, k, v, out, m, l, indptr, indices, tptr, tind, perm,
                                     None, scale, dtype, piece=3, t=t)
        assert_large_score_accuracy(q, k, v, dout, M, scale, out, m, dq, dk, dv)


def case_large_scores_decode():
    """The split-key decode forward (2 query rows over 19 keys, bottom-right causal, split in 3
    and merged) with the blocks backward at large scores. Not met yet: decode sums a dot
    product over its lane groups in another order than the blocks backward recomputes it, so
    the recomputed row max differs from m by a rounding of the score, which exp() turns into a
    factor of e^(ulp(s)) on P (e^8 at 1e8); test_simulated_kernels marks it xfail."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_robustness import assert_large_score_accuracy
    from tiga_numba.cuda.decode import DecodeTiles
    H, Hkv, D, scale = 2, 1, 4, 0.3
    for dtype, mx in (("float32", 1e6), ("float32", 1e8), ("float16", 3e4)):
        seed = int(np.log10(mx))
        dst_off, src_off = np.array([0, 2], np.int64), np.array([0, 19], np.int64)
        lo, hi = np.array([-1], np.int64), np.array([17], np.int64)
        rel = (dst_off, src_off, np.zeros(1, np.uint8), lo, hi)
        M = band_mask(dst_off, src_off, lo, hi, 2, 19)
        q, k, v, dout = _large_inputs(M, H, Hkv, D, dtype, mx, scale, seed + 2)
        td = DecodeTiles(dtype, "float32", D, D, G=2, T=2, NW=1, ROWS=4, threads=4)
        out, m, l = decode_forward(q, k, v, rel, scale, dtype, td, 3, 8)
        dq, dk, dv, _ = blocks_backward(dout, q, k, v, out, m, l, rel, scale, dtype)
        assert_large_score_accuracy(q, k, v, dout, M, scale, out, m, dq, dk, dv)


CASES = {
    "large_scores": case_large_scores,
    "large_scores_decode": case_large_scores_decode,
    "csr_split_hub": case_csr_split_hub,
    "decode_split": case_decode_split,
    "blocks_banded_nan": case_banded_nan,
    "blocks_causal_nan": case_causal_nan,
    "nan_l_backward": case_nan_l_backward,
    "blocks_f32_gqa_segments": lambda: case_blocks(),
    "blocks_f64_dense_rect": lambda: case_blocks("float64", H=2, Hkv=2, D=4, DV=2,
                                                 layout=(("d", 6, 13, 0),), tol=1e-12),
    "blocks_f16_mixed_strided": lambda: case_blocks("float16", H=3, Hkv=1, D=5, DV=3,
                                                    layout=(("d", 7, 4, 0), ("c", 6, 6, 1)),
                                                    strided_inputs=True, tol=2e-3),
    "prune": case_prune,
    "csr_f32_bias_gqa": lambda: case_csr(),
    "csr_f64_nobias": lambda: case_csr("float64", H=2, Hkv=2, with_bias=False, tol=1e-12),
    "csr_edge_score_d0": lambda: case_csr("float32", H=2, Hkv=2, D=0, DV=3),
    "blocks_lane_groups": case_lane_groups,
}

assert sorted(CASES) == sorted(SIM_CASES)

if __name__ == "__main__":
    import sim_support  # faster thread hand-over, atomic shared-array allocation
    sim_support.prepare_simulator()
    _kernels()
    names = sys.argv[1:] or list(CASES)
    for n in names:
        CASES[n]()
    print("ALL OK")
