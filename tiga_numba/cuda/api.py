"""CUDA backend entry points (docs/INTERNALS.md, "Backend entry points").

    forward(plan, q, k, v, relation, edge_bias=None) -> (out, m, l)
    backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias=None)
        -> (dq, dk, dv, dbias)

cupy arrays in, cupy arrays out, on cupy's current stream. Inputs are read in place with
their strides (the kernels take element strides); only arrays with negative or
non-element-multiple strides, and non-contiguous per-row stats / edge bias, are copied,
and each copy is recorded in plan.run_info["copies"].

Routing: the tensor-core kernels (tiga_numba.cuda.tc, when present) take what their
`supports()` accepts; everything else runs on the CUDA-core kernels of blocks.py / csr.py.
"""
from __future__ import annotations

import functools
import math

import cupy
import numpy as np

from ..kernel_cache import KERNELS
from . import blocks as _blocks
from . import csr as _csr
from . import tiles as _tiles
from .common import make_delta, make_stats
from .launch import current_stream

try:  # the tensor-core helper's package; absent or partial -> CUDA-core kernels only
    from . import tc as _tc
except ImportError:  # pragma: no cover
    _tc = None


# Test hooks: USE_TC=False keeps every call on the CUDA-core kernels of this package;
# POISON=True fills every output with NaN before the kernels run (unwritten element -> NaN).
USE_TC = True
POISON = False


def _empty(shape, dtype):
    if POISON:
        return cupy.full(shape, np.nan, dtype)
    return cupy.empty(shape, dtype)


def _tc_supports(plan, q, k, v, relation):
    if not USE_TC:
        return False
    supports = getattr(_tc, "supports", None) if _tc is not None else None
    if supports is None or not hasattr(_tc, "forward"):
        return False
    return bool(supports(plan, q, k, v, relation))


def _is_blocks(relation):
    return hasattr(relation, "dst_offsets")


@functools.lru_cache(maxsize=None)
def _block_tiles(kind, dtype, D, DV):
    return _tiles.block_tiles(kind, dtype, D, DV)


@functools.lru_cache(maxsize=None)
def _csr_tiles(kind, dtype, D, DV):
    return _tiles.csr_tiles(kind, dtype, D, DV)


class _Calls:
    """Kernels used by one entry-point call: cache hit/miss and IR for run_info."""

    def __init__(self):
        self.kernels = []
        self.hit = True

    def get(self, key, build):
        kern = KERNELS.get(("cuda",) + key, build)
        self.hit = self.hit and bool(KERNELS.last_was_hit)
        self.kernels.append(kern)
        return kern

    def ir(self):
        kernels = list(self.kernels)

        def stage(name):
            def text():
                parts = []
                for kern in kernels:
                    body = kern.llvm() if name == "llvm" else kern.ptx()
                    parts.append(f"// ---- {kern.name}\n{body}")
                return "\n".join(parts)
            return text
        return {"llvm": stage("llvm"), "ptx": stage("ptx")}


def _view(x, name, copies):
    """(array kept alive, device address, element strides) of a 3-D array."""
    item = x.dtype.itemsize
    s0, s1, s2 = x.strides
    if s0 < 0 or s1 < 0 or s2 < 0 or s0 % item or s1 % item or s2 % item:
        copies.append(f"{name}: strides {x.strides} (negative or not a multiple of the item "
                      "size) -> contiguous copy")
        x = cupy.ascontiguousarray(x)
        s0, s1, s2 = x.strides
    return x, x.data.ptr, s0 // item, s1 // item, s2 // item


def _contig(x, dtype, name, copies):
    if x is None:
        return None
    if x.dtype != dtype or not x.flags.c_contiguous:
        copies.append(f"{name}: {x.dtype} {'contiguous' if x.flags.c_contiguous else 'strided'} "
                      f"-> contiguous {np.dtype(dtype).name} copy")
        x = cupy.ascontiguousarray(x, dtype=dtype)
    return x


def _ptr(x):
    return 0 if x is None else x.data.ptr


_DUMMY = {}


def _dummy(dtype):
    """A 2-element device array passed where a kernel takes an unused array argument."""
    key = (cupy.cuda.runtime.getDevice(), dtype)
    d = _DUMMY.get(key)
    if d is None:
        d = _DUMMY[key] = cupy.zeros(2, dtype)
    return d


_DTYPES = {}


def _dtypes(dt):
    """(input dtype, its name, accumulation dtype), memoised: dtype.name is slow."""
    r = _DTYPES.get(dt)
    if r is None:
        d = np.dtype(dt)
        r = _DTYPES[dt] = (d, d.name, np.dtype(_tiles.acc_of(d.name)))
    return r


_K_BLOCKS = "cuda.blocks.forward (CUDA cores, streaming online softmax)"
_K_BLOCKS_PRUNE = "cuda.blocks.forward (CUDA cores, streaming online softmax, tile pruning)"
_K_CSR = "cuda.csr.forward (CUDA cores, online softmax per edge)"
_K_CSR_BIAS = "cuda.csr.forward (CUDA cores, online softmax per edge, edge bias)"


def _cdiv(a, b):
    return -(-a // b)


# --------------------------------------------------------------------------- forward
def forward(plan, q, k, v, relation, edge_bias=None):
    info = plan.run_info
    if _tc_supports(plan, q, k, v, relation):
        info["kernel"] = "cuda.tc (tensor cores)"
        return _tc.forward(plan, q, k, v, relation, edge_bias)

    copies = []
    calls = _Calls()
    stream = current_stream()
    Nq, H, D = q.shape
    Hkv = k.shape[1]
    DV = v.shape[2]
    dtype, dname, acc = _dtypes(q.dtype)
    q, qp, qs0, qs1, qs2 = _view(q, "q", copies)
    k, kp, ks0, ks1, ks2 = _view(k, "k", copies)
    v, vp, vs0, vs1, vs2 = _view(v, "v", copies)
    out = _empty((Nq, H, DV), dtype)
    m = _empty((Nq, H), acc)
    l = _empty((Nq, H), acc)
    scale = float(plan.scale)
    grp = H // Hkv

    if _is_blocks(relation):
        if edge_bias is not None:
            raise NotImplementedError("edge_bias needs a CSR relation; the CUDA block kernels "
                                      "take no per-edge fields")
        rho = plan.prune_threshold
        prune = rho is not None
        t = _block_tiles("fwd", dname, D, DV)
        kern = calls.get(("blocks.fwd", t, prune), lambda: _blocks.make_forward(t, prune))
        S = int(relation.causal.shape[0])
        tpb = _cdiv(int(relation.max_block_dst), t.BM)
        cnt = cupy.zeros(2, np.int64) if prune else _dummy("int64")
        if S * tpb == 0:
            out.fill(0)
            m.fill(-np.inf)
            l.fill(0)
        else:
            kern((S * tpb, H, 1), (t.NT, 1, 1), stream, qp, kp, vp, out.data.ptr, m.data.ptr,
                 l.data.ptr, relation.dst_offsets.data.ptr, relation.src_offsets.data.ptr,
                 relation.causal.data.ptr, cnt.data.ptr, qs0, qs1, qs2, ks0, ks1, ks2,
                 vs0, vs1, vs2, tpb, H, grp, scale, math.log(rho) if prune else 0.0)
        info["kernel"] = _K_BLOCKS_PRUNE if prune else _K_BLOCKS
        info["tiles"] = t.describe()
        if prune:
            pruned, total = (int(x) for x in cnt.get(stream=cupy.cuda.get_current_stream()))
            info["pruned_tiles"] = pruned
            info["total_tiles"] = total
    else:
        bias = _contig(edge_bias, acc, "edge_bias", copies)
        t = _csr_tiles("fwd", dname, D, DV)
        has_bias = bias is not None
        kern = calls.get(("csr.fwd", t, has_bias), lambda: _csr.make_forward(t, has_bias))
        threads = Nq * H * t.G
        if threads:
            kern((_cdiv(threads, t.NT), 1, 1), (t.NT, 1, 1), stream, qp, kp, vp, out.data.ptr,
                 m.data.ptr, l.data.ptr, relation.indptr.data.ptr, relation.indices.data.ptr,
                 _ptr(bias), qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, Nq, H, grp, scale)
        info["kernel"] = _K_CSR_BIAS if has_bias else _K_CSR
        info["tiles"] = t.describe_csr()
    info["copies"] = copies
    info["cache"] = "hit" if calls.hit else "miss"
    info["ir"] = calls.ir()
    return out, m, l


# --------------------------------------------------------------------------- backward
def backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias=None):
    info = plan.run_info
    if _tc_supports(plan, q, k, v, relation) and hasattr(_tc, "backward"):
        info["kernel"] = "cuda.tc (tensor cores)"
        return _tc.backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias)

    copies = []
    calls = _Calls()
    stream = current_stream()
    Nq, H, D = q.shape
    Ns, Hkv, _ = k.shape
    DV = v.shape[2]
    dtype = np.dtype(q.dtype)
    acc = np.dtype(_tiles.acc_of(dtype.name))
    scale = float(plan.scale)
    grp = H // Hkv
    q, qp, qs0, qs1, qs2 = _view(q, "q", copies)
    k, kp, ks0, ks1, ks2 = _view(k, "k", copies)
    v, vp, vs0, vs1, vs2 = _view(v, "v", copies)
    if dout.dtype != dtype:
        copies.append(f"dout: {dout.dtype} -> {dtype.name} copy")
        dout = dout.astype(dtype)
    if out.dtype != dtype:
        copies.append(f"out: {out.dtype} -> {dtype.name} copy")
        out = out.astype(dtype)
    dout, dop, os0, os1, os2 = _view(dout, "dout", copies)
    out, outp, oo0, oo1, oo2 = _view(out, "out", copies)
    m = _contig(m, acc, "stats.m", copies)
    l = _contig(l, acc, "stats.l", copies)

    # Delta_i = sum(dO_i * O_i): one pass, read by both gradient kernels (the CSR kernels get
    # it interleaved with lse = m + log(l), one pair per gathered (row, head))
    csr_rel = not _is_blocks(relation)
    if csr_rel:
        delta = _empty((Nq, H, 2), acc)
        dk_ = calls.get(("stats", dtype.name, acc.name), lambda: make_stats(dtype.name, acc.name))
        dargs = (dop, outp, m.data.ptr, l.data.ptr, delta.data.ptr)
    else:
        delta = _empty((Nq, H), acc)
        dk_ = calls.get(("delta", dtype.name, acc.name), lambda: make_delta(dtype.name, acc.name))
        dargs = (dop, outp, delta.data.ptr)
    if Nq * H:
        dk_((_cdiv(Nq * H, dk_.rows_per_cta), 1, 1), (dk_.NT, 1, 1), stream, *dargs,
            os0, os1, os2, oo0, oo1, oo2, Nq * H, H, DV)

    dq = _empty((Nq, H, D), dtype)
    dk = _empty((Ns, Hkv, D), dtype)
    dv = _empty((Ns, Hkv, DV), dtype)
    dbias = None
    strides = (qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2)
    if _is_blocks(relation):
        if edge_bias is not None:
            raise NotImplementedError("edge_bias needs a CSR relation")
        S = int(relation.causal.shape[0])
        tq = _block_tiles("dq", dtype.name, D, DV)
        tk = _block_tiles("dkdv", dtype.name, D, DV)
        kq = calls.get(("blocks.dq", tq), lambda: _blocks.make_dq(tq))
        kk = calls.get(("blocks.dkdv", tk), lambda: _blocks.make_dkdv(tk))
        rel = (relation.dst_offsets.data.ptr, relation.src_offsets.data.ptr,
               relation.causal.data.ptr)
        tpb = _cdiv(int(relation.max_block_dst), tq.BM)
        if S * tpb:
            kq((S * tpb, H, 1), (tq.NT, 1, 1), stream, qp, kp, vp, dop, m.data.ptr, l.data.ptr,
               delta.data.ptr, dq.data.ptr, *rel, *strides, tpb, H, grp, scale)
        else:
            dq.fill(0)
        tpbk = _cdiv(int(relation.max_block_src), tk.BM)
        if S * tpbk:
            kk((S * tpbk, Hkv, 1), (tk.NT, 1, 1), stream, qp, kp, vp, dop, m.data.ptr,
               l.data.ptr, delta.data.ptr, dk.data.ptr, dv.data.ptr, *rel, *strides,
               tpbk, H, grp, scale)
        else:
            dk.fill(0)
            dv.fill(0)
        info["kernel"] = ("cuda.blocks.backward (CUDA cores, deterministic: dq by query tiles, "
                          "dk/dv by key tiles)")
        info["tiles"] = f"dq: {tq.describe()}; dk/dv: {tk.describe()}"
    else:
        bias = _contig(edge_bias, acc, "edge_bias", copies)
        has_bias = bias is not None
        E = int(relation.indices.shape[0])
        if has_bias:
            dbias = _empty((E, H), acc)
        tq = _csr_tiles("bwd", dtype.name, D, DV)
        kq = calls.get(("csr.dq", tq, has_bias), lambda: _csr.make_dq(tq, has_bias))
        kk = calls.get(("csr.dkdv", tq, has_bias), lambda: _csr.make_dkdv(tq, has_bias))
        if Nq * H:
            kq((_cdiv(Nq * H * tq.G, tq.NT), 1, 1), (tq.NT, 1, 1), stream, qp, kp, vp, dop,
               delta.data.ptr, dq.data.ptr, _ptr(dbias),
               relation.indptr.data.ptr, relation.indices.data.ptr, _ptr(bias), *strides,
               Nq, H, grp, scale)
        if Ns * Hkv:
            kk((_cdiv(Ns * Hkv * tq.G, tq.NT), 1, 1), (tq.NT, 1, 1), stream, qp, kp, vp, dop,
               delta.data.ptr, dk.data.ptr, dv.data.ptr,
               transpose.indptr.data.ptr, transpose.indices.data.ptr, transpose.perm.data.ptr,
               _ptr(bias), *strides, Ns, H, grp, scale)
        info["kernel"] = ("cuda.csr.backward (CUDA cores, deterministic: dq"
                          + (" and dbias" if has_bias else "")
                          + " by destination rows, dk/dv by source rows of the transposed CSR)")
        info["tiles"] = f"{tq.G} lanes per (row, head), {tq.NT} threads per CTA"
    info["copies"] = copies
    info["cache"] = "hit" if calls.hit else "miss"
    info["ir"] = calls.ir()
    return dq, dk, dv, dbias
