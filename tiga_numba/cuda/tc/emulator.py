"""Numpy warp emulator for the generated tensor-core kernels (CPU only, no numba needed).

Every per-thread scalar of the generated source becomes a numpy vector over the CTA's threads;
all warps run in lockstep, so barriers and cp.async waits are no-ops. Each intrinsic of ptx.py
gets its warp-level meaning here (mma m16n8k16 and m16n8k8.tf32, ldmatrix(.trans), zero-filling
cp.async, predicated loads/stores, shfl.xor, f32 <-> f16/bf16 packing, the cvt.rna.tf32 split).
tf32 is emulated bit-exactly: cvt.rna rounds the mantissa to 10 bits (ties away from zero) and
the mma reads only the top 19 bits of each operand, so a kernel that skipped a 3xTF32 pass or a
split would show plain-TF32 errors here. Every global access is checked
against the registered buffers and every shared access against the CTA's shared size, so a
layout, swizzle, tail or mask mistake fails here, in CI, before any GPU sees it.

The asynchronous engines are modelled by when their data moves, so a program that uses data
too early or overwrites it too soon fails here too: a cp.async chunk reads global memory when
issued but lands only at the cp.async.wait_group that covers its commit group (until then its
shared bytes read as NaN patterns), and a wgmma chain issued without waiting is computed at issue
and again at its wgmma_wait, which fails unless both read the same operands (a buffer refilled, or
an operand tile rewritten, while the tensor cores may still read it).

What it cannot see: races between warps (lockstep hides them; compute-sanitizer's racecheck
covers them on the GPU) and timing.
"""
from __future__ import annotations

import re
import types as _types

import numpy as np

from . import barriers, clamps, copies, generator as G
from .ptx import chain_operands


# ----------------------------------------------------------------------------- element formats
def f32_to_bits(x, dtype):
    """round-to-nearest-even f32 -> 16-bit pattern (uint32) of float16 or bfloat16."""
    x = np.asarray(x, np.float32)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16).astype(np.uint32)
    b = x.view(np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (r & 0xFFFF).astype(np.uint32)


def bits_to_f32(u, dtype):
    u = np.asarray(u, np.uint32) & 0xFFFF
    if dtype == "float16":
        return u.astype(np.uint16).view(np.float16).astype(np.float32)
    return (u << 16).astype(np.uint32).view(np.float32)


def to_storage(x, dtype):
    """numpy float array -> storage of the kernel's element type (uint16 bits; float32 as is)."""
    if dtype == "float32":
        return np.asarray(x, np.float32)
    return f32_to_bits(np.asarray(x, np.float32), dtype).astype(np.uint16)


def from_storage(u16, dtype):
    if dtype == "float32":
        return np.asarray(u16, np.float32)
    return bits_to_f32(u16.astype(np.uint32), dtype)


def storage_dtype(dtype):
    return np.float32 if dtype == "float32" else np.uint16


def tf32_rna(bits):
    """cvt.rna.tf32.f32 on fp32 bit patterns: mantissa rounded to 10 bits, ties away from zero
    (adding half an ulp to the magnitude; the sign bit is untouched), low 13 bits cleared."""
    b = np.asarray(bits, np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32)


def round_toward_zero(x):
    """float64 -> float32 truncated toward zero: the model of the tensor cores' fp32 accumulation
    used for mma1688 (the exact sum of the products and C, then truncated). Truncation biases a
    fed-back accumulator by ~2^-24 per mma, which is what made O/dQ/dK/dV errors grow with N on
    the H200 before mma_pb accumulated per block (generator.PB_PAIRS)."""
    x = np.asarray(x, np.float64)
    r = x.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(x)
    return np.where(over, np.nextafter(r, np.float32(0)), r).astype(np.float32)


def tf32_value(bits):
    """the value an mma.tf32 operand register stands for: its low 13 bits are not read."""
    return (np.asarray(bits, np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


# ----------------------------------------------------------------------------- memory
class Memory:
    """Flat global memory with registered buffers; any access outside them raises."""

    def __init__(self):
        self.buf = np.zeros(0, np.uint8)
        self.regions = []

    def alloc(self, nbytes, fill=0xFF):
        base = (len(self.buf) + 255) // 256 * 256 + 256   # gaps between buffers catch overruns
        new = np.full(base + nbytes, 0xEE, np.uint8)
        new[:len(self.buf)] = self.buf
        new[base:] = fill
        self.buf = new
        self.regions.append((base, base + nbytes))
        return base

    def put(self, array):
        a = np.ascontiguousarray(array)
        base = self.alloc(a.nbytes)
        self.buf[base:base + a.nbytes] = a.view(np.uint8).ravel()
        return base

    def get(self, base, dtype, shape):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.buf[base:base + n].view(dtype).reshape(shape).copy()

    def check(self, addr, nbytes):
        addr = np.atleast_1d(np.asarray(addr, np.int64))
        ok = np.zeros(addr.shape, bool)
        for lo, hi in self.regions:
            ok |= (addr >= lo) & (addr + nbytes <= hi)
        if not ok.all():
            bad = addr[~ok][0]
            raise IndexError(f"global access out of bounds at {bad} ({nbytes} bytes)")


#: False: an mma / wgmma operand holding NaN fails at once (unset fragment registers are NaN, so a
#: layout bug shows up as NaN there). The tests that put inf / NaN into the inputs on purpose set it
#: True: the operands may then carry the data's NaN (the layout checks are the other tests' job).
NAN_DATA = False


# ----------------------------------------------------------------------------- the warp machine
class Warps:
    def __init__(self, NT, smem_bytes, mem, dtype):
        self.NT, self.mem, self.dtype = NT, mem, dtype
        # wgmma operands: float32 kernels multiply bf16 parts (generator "split")
        self.wg_dtype = "bfloat16" if dtype == "float32" else dtype
        self.SM = np.full(smem_bytes, 0xEE, np.uint8)   # garbage: reads of unloaded smem show up
        self.pending = []   # wgmma chains issued without waiting: (results, recompute), oldest first
        self.cp_open = []   # cp.async chunks (shared address, 16 bytes) not yet committed
        self.cp_groups = []  # committed cp.async groups, oldest first, not yet waited for
        self.mbar = {}      # shared address -> mbarrier state (mbar_init)
        lane = np.arange(NT) % 32
        self.wv, self.g, self.t = np.arange(NT) // 32, lane // 4, lane % 4

    def _vec(self, x, dt):
        # a fresh (NT,) array of x (a scalar or a per-thread vector): filled by assignment, which
        # broadcasts as np.broadcast_to does at a fraction of its cost (called for every operand)
        out = np.empty(self.NT, dt)
        out[...] = np.asarray(x, dt)
        return out

    def _smem16(self, addr):
        addr = self._vec(addr, np.int64)
        assert np.all(addr % 16 == 0), "16-byte alignment of shared access"
        assert np.all((addr >= 0) & (addr + 16 <= len(self.SM))), "shared access out of bounds"
        return addr

    # -- tensor cores
    def mma16816(self, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        nw, wv, g, t, dt = self.NT // 32, self.wv, self.g, self.t, self.dtype
        A = self._a_frag((a0, a1, a2, a3))
        B = np.full((nw, 16, 8), np.nan, np.float32)
        C = np.full((nw, 16, 8), np.nan, np.float32)
        for reg, ko in ((b0, 0), (b1, 8)):
            reg = self._vec(reg, np.uint32)
            B[wv, 2 * t + ko, g] = bits_to_f32(reg, dt)
            B[wv, 2 * t + ko + 1, g] = bits_to_f32(reg >> 16, dt)
        for c, ro, co in ((c0, 0, 0), (c1, 0, 1), (c2, 8, 0), (c3, 8, 1)):
            C[wv, g + ro, 2 * t + co] = self._vec(c, np.float32)
        assert NAN_DATA or not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(C).any()), \
            "mma operand not fully defined (fragment layout bug or NaN data)"
        Dm = (A.astype(np.float64) @ B.astype(np.float64) + C).astype(np.float32)
        return Dm[wv, g, 2 * t], Dm[wv, g, 2 * t + 1], Dm[wv, g + 8, 2 * t], Dm[wv, g + 8, 2 * t + 1]

    def mma1688(self, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """mma.m16n8k8.row.col.f32.tf32.tf32.f32 (fragment layouts: generator docstring)."""
        nw, wv, g, t = self.NT // 32, self.wv, self.g, self.t
        A = np.full((nw, 16, 8), np.nan, np.float32)
        B = np.full((nw, 8, 8), np.nan, np.float32)
        C = np.full((nw, 16, 8), np.nan, np.float32)
        for reg, ro, ko in ((a0, 0, 0), (a1, 8, 0), (a2, 0, 4), (a3, 8, 4)):
            A[wv, g + ro, t + ko] = tf32_value(self._vec(reg, np.uint32))
        for reg, ko in ((b0, 0), (b1, 4)):
            B[wv, t + ko, g] = tf32_value(self._vec(reg, np.uint32))
        for c, ro, co in ((c0, 0, 0), (c1, 0, 1), (c2, 8, 0), (c3, 8, 1)):
            C[wv, g + ro, 2 * t + co] = self._vec(c, np.float32)
        assert NAN_DATA or not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(C).any()), \
            "mma operand not fully defined (fragment layout bug or NaN data)"
        Dm = round_toward_zero(A.astype(np.float64) @ B.astype(np.float64) + C)
        return Dm[wv, g, 2 * t], Dm[wv, g, 2 * t + 1], Dm[wv, g + 8, 2 * t], Dm[wv, g + 8, 2 * t + 1]

    # -- wgmma (sm_90a): warpgroup products, operands from shared memory through descriptors
    def _desc(self, desc):
        """(start, LBO, SBO) per warpgroup of a matrix descriptor, which must be uniform across the
        group's 128 threads and use the 128-byte swizzle with base offset 0 (aligned tiles)."""
        d = self._vec(desc, np.int64).reshape(-1, 128)
        assert np.all(d == d[:, :1]), "wgmma descriptor differs within a warpgroup"
        d = d[:, 0].astype(np.uint64)
        assert np.all(d >> np.uint64(62) == 1), "wgmma descriptor: swizzle mode must be 1 (128 B)"
        assert np.all((d >> np.uint64(49)) & np.uint64(7) == 0), "wgmma descriptor: base offset must be 0"
        field = lambda sh: (((d >> np.uint64(sh)) & np.uint64(0x3FFF)) << np.uint64(4)).astype(np.int64)  # noqa: E731
        return field(0), field(16), field(32)

    def _sw128(self, addr):
        """16-bit elements at byte addresses `addr` through the hardware's 128-byte swizzle (bits 4-6
        of the address XOR bits 7-9)."""
        addr = np.asarray(addr, np.int64)
        addr = addr ^ (((addr >> 7) & 7) << 4)
        assert np.all((addr >= 0) & (addr + 2 <= len(self.SM))), "wgmma operand outside shared memory"
        return bits_to_f32(self.SM[addr].astype(np.uint32) | (self.SM[addr + 1].astype(np.uint32) << 8), self.wg_dtype)

    def _a_frag(self, regs):
        """a warp's 16 x 16 A operand from mma.sync's A fragment registers (4 packed words; the
        register A of wgmma uses the same layout)."""
        wv, g, t, dt = self.wv, self.g, self.t, self.wg_dtype
        A = np.full((self.NT // 32, 16, 16), np.nan, np.float32)
        for reg, ro, co in zip(regs, (0, 8, 0, 8), (0, 0, 8, 8)):
            reg = self._vec(reg, np.uint32)
            A[wv, g + ro, 2 * t + co] = bits_to_f32(reg, dt)
            A[wv, g + ro, 2 * t + co + 1] = bits_to_f32(reg >> 16, dt)
        return A

    def wgmma_chain(self, form, N, steps, args, wait=True):
        """ptx.wgmma_chain (see _chain). wait=False: issued, not waited for: the registers hold no
        result until wgmma_wait hands it over (a program that reads them early computes with NaN
        and fails its checks), and the chain is computed again at the wait, which must read the
        same operands."""
        out = self._chain(form, N, steps, args)
        if wait:
            return out
        self.pending.append((out, lambda: self._chain(form, N, steps, args)))
        return tuple(np.full(self.NT, np.nan, np.float32) for _ in out)

    def _chain(self, form, N, steps, args):
        """ptx.wgmma_chain: C += A B per step (m64n{N}k16). ss: args (da, db, *C), A and B K-major
        from descriptors da + a, db + b; st: as ss with B MN-major; rs: args (*A registers, db, *C),
        A from register group a (4 packed words), B MN-major (imm-trans-b = 1) from db + b. Warp w of
        its warpgroup holds rows 16 (w % 4) .. + 15 in C layout."""
        nw, wv, g, t = self.NT // 32, self.wv, self.g, self.t
        assert self.NT % 128 == 0, "wgmma needs whole warpgroups"
        na = chain_operands(form, steps)
        c_in = args[na:]
        assert len(c_in) == N // 2
        C = np.full((nw, 16, N), np.nan, np.float32)
        for i, c in enumerate(c_in):
            j, r = divmod(i, 4)
            C[wv, g + 8 * (r // 2), 8 * j + 2 * t + r % 2] = self._vec(c, np.float32)
        acc = C.astype(np.float64)
        kk, nn = np.arange(16)[:, None], np.arange(N)[None, :]
        for a, b in steps:
            if form == "rs":
                A = self._a_frag(args[4 * a:4 * a + 4])
            else:
                start, _, sbo = self._desc(self._vec(args[0], np.int64) + a)
                m = np.arange(64)[:, None]
                A = self._sw128(start[:, None, None] + (m // 8 * sbo[:, None, None] + m % 8 * 128 + 2 * kk.T))
                A = A.reshape(nw, 16, 16)   # warp 4 wg + i: rows 16 i .. of its group's 64
            start, lbo, sbo = self._desc(self._vec(args[na - 1], np.int64) + b)
            s3, l3, b3 = start[:, None, None], lbo[:, None, None], sbo[:, None, None]
            if form in ("rs", "st"):   # MN-major: 8 k rows of 128 B, the next 8 at SBO, the next 64 columns at LBO
                B = self._sw128(s3 + kk // 8 * b3 + kk % 8 * 128 + nn // 64 * l3 + 2 * (nn % 64))
            else:              # K-major: n rows of 128 B (the next 8 at SBO), k contiguous
                B = self._sw128(s3 + nn // 8 * b3 + nn % 8 * 128 + 2 * kk)
            B = np.repeat(B, 4, axis=0)   # every warp of a group sees its group's B
            assert NAN_DATA or not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(acc).any()), \
                "wgmma operand not fully defined (layout bug or NaN data)"
            # fp32 accumulator after every instruction, as mma16816 models it; float32 kernels
            # (split) are held to the truncating accumulation, as mma1688 (see round_toward_zero)
            acc = A.astype(np.float64) @ B.astype(np.float64) + acc
            acc = (round_toward_zero(acc) if self.dtype == "float32" else acc.astype(np.float32)).astype(np.float64)
        D = acc.astype(np.float32)
        return tuple(D[wv, g + 8 * (r // 2), 8 * j + 2 * t + r % 2] for j in range(N // 8) for r in range(4))

    def wgmma_wait(self, n, count, regs):
        """ptx.wgmma_wait: the oldest in-flight chain completes (at most n stay in flight); its
        results replace the `count` tied registers, which must be exactly its accumulators."""
        assert len(self.pending) > n, "wgmma_wait: no chain in flight to complete"
        assert len(self.pending) == n + 1, \
            "wgmma_wait: more than one chain would complete (tie each one's registers)"
        out, again = self.pending.pop(0)
        assert len(out) == count == len(regs), "wgmma_wait: tied registers are not the completed chain's accumulators"
        assert all(np.isnan(np.asarray(x)).all() for x in regs), "wgmma_wait: tied registers were written while in flight"
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(out, again())), \
            "wgmma_wait: an operand of the chain changed while it was in flight (shared memory reused too early)"
        return out

    def tf32x2(self, x):
        """(big, small) = (rna(x), rna(x - big)) on fp32 values or their u32 bit patterns."""
        x = np.asarray(x)
        bits = self._vec(x.view(np.uint32) if x.dtype == np.float32 else x, np.uint32)
        big = tf32_rna(bits)
        rest = (bits.view(np.float32) - big.view(np.float32)).astype(np.float32)   # exact in fp32
        return big, tf32_rna(rest.view(np.uint32))

    def lds64(self, addr):
        addr = self._vec(addr, np.int64)
        assert np.all(addr % 8 == 0), "8-byte alignment of shared access"
        assert np.all((addr >= 0) & (addr + 8 <= len(self.SM))), "shared access out of bounds"
        w = self.SM[addr[:, None] + np.arange(8)].view(np.uint32)   # (NT, 2)
        return w[:, 0].copy(), w[:, 1].copy()

    def _ldsm(self, addr, trans):
        addr = self._smem16(addr)
        R = self.SM[addr[:, None] + np.arange(16)].view(np.uint16).astype(np.uint32)   # (NT, 8 halves)
        M = R.reshape(self.NT // 32, 4, 8, 8)   # warp, matrix, row, col
        wv, g, t = self.wv, self.g, self.t
        out = []
        for m in range(4):
            if trans:
                lo, hi = M[wv, m, 2 * t, g], M[wv, m, 2 * t + 1, g]
            else:
                lo, hi = M[wv, m, g, 2 * t], M[wv, m, g, 2 * t + 1]
            out.append((lo | (hi << 16)).astype(np.uint32))
        return tuple(out)

    def ldsm_x4(self, addr):
        return self._ldsm(addr, False)

    def ldsm_x4_t(self, addr):
        return self._ldsm(addr, True)

    # -- memory
    def cp_async16(self, saddr, gaddr, nbytes):
        self._cp_async(16, 1, saddr, gaddr, nbytes)

    def cp_async8_if(self, pred, saddr, gaddr, nbytes):   # copies.py
        self._cp_async(8, pred, saddr, gaddr, nbytes)

    def cp_async4_if(self, pred, saddr, gaddr, nbytes):   # copies.py
        self._cp_async(4, pred, saddr, gaddr, nbytes)

    def _cp_async(self, size, pred, saddr, gaddr, nbytes):
        """cp.async of `size` bytes in the threads where pred != 0: nbytes (size or 0) read from
        global, the rest zero-filled; lands at the thread's wait covering its commit group."""
        on = self._vec(pred, np.int64) != 0
        saddr = self._vec(saddr, np.int64)[on]
        gaddr = self._vec(gaddr, np.int64)[on]
        nbytes = self._vec(nbytes, np.int64)[on]
        assert np.all((nbytes == 0) | (nbytes == size))
        assert np.all(saddr % size == 0), f"{size}-byte alignment of shared destination"
        assert np.all((saddr >= 0) & (saddr + size <= len(self.SM))), "shared access out of bounds"
        assert np.all(gaddr % size == 0), f"{size}-byte alignment of global source"
        rd = nbytes > 0
        if rd.any():
            self.mem.check(gaddr[rd], size)
        data = self.mem.buf[np.where(rd, gaddr, 0)[:, None] + np.arange(size)]
        data[~rd] = 0
        dst = saddr[:, None] + np.arange(size)
        self.SM[dst] = 0xFF   # in flight: all-ones bytes are NaN in every element format
        self.cp_open.append((dst, data))

    def cp_commit(self):
        """cp.async.commit_group: the chunks issued since the last commit form one group."""
        self.cp_groups.append(self.cp_open)
        self.cp_open = []

    def cp_wait(self, n):
        """cp.async.wait_group n: every committed group but the newest n has landed."""
        while len(self.cp_groups) > n:
            for dst, data in self.cp_groups.pop(0):
                self.SM[dst] = data

    # -- mbarriers and named barriers (barriers.py): the warps run in lockstep, so an arrival that a
    # wait needs has happened earlier in program order or never; a wait that would never pass is
    # an error here (on a GPU: a hang), and copies tracked by a barrier land only at a wait on it
    def _uniform(self, x, what):
        x = np.asarray(x)
        assert np.all(x == x.flat[0]), f"{what} differs between threads"
        return int(x.flat[0])

    def mbar_init_if(self, pred, addr, count):
        assert np.count_nonzero(self._vec(pred, np.uint32)) == 1, "an mbarrier is initialised by one thread"
        addr = self._uniform(addr, "mbarrier address")
        assert addr % 8 == 0 and 0 <= addr and addr + 8 <= len(self.SM), "mbarrier outside shared memory"
        assert addr not in self.mbar, "mbarrier initialised twice"
        self.mbar[addr] = dict(count=self._uniform(count, "mbarrier count"), arrived=0, phase=0, landing={})

    def mbar_init_fence(self):
        pass

    def _mbar(self, addr):
        addr = self._uniform(addr, "mbarrier address")
        assert addr in self.mbar, "mbarrier used before its mbarrier.init"
        return self.mbar[addr]

    def _arrive(self, b, n):
        b["arrived"] += n
        assert b["arrived"] <= b["count"], "more arrivals than the mbarrier's phase expects"
        if b["arrived"] == b["count"]:
            b["phase"] += 1
            b["arrived"] = 0

    def mbar_arrive(self, addr):
        """every thread arrives (the generator never predicates these)."""
        self._arrive(self._mbar(addr), self.NT)

    def mbar_cp_arrive(self, addr):
        """cp.async.mbarrier.arrive.noinc: each thread's earlier copies (every cp.async not yet
        tracked) belong to the barrier's current phase and land when a wait on it passes."""
        b = self._mbar(addr)
        b["landing"].setdefault(b["phase"], []).extend(self.cp_open)
        self.cp_open = []
        self._arrive(b, self.NT)

    def mbar_wait(self, addr, parity):
        """try_wait.parity loop: passes once the phase of that parity completed (the current phase's
        parity differs); then every copy of the completed phases has landed."""
        b = self._mbar(addr)
        p = self._uniform(parity, "mbarrier wait parity")
        assert b["phase"] % 2 != p, "an mbarrier wait for a phase that no thread completes (a hang on a GPU)"
        for ph in sorted(x for x in b["landing"] if x < b["phase"]):
            for dst, data in b["landing"].pop(ph):
                self.SM[dst] = data

    def bar_sync_n(self, bid, count):
        """bar.sync / bar.arrive id, count: the id may differ between warpgroups, not inside one."""
        ids = self._vec(bid, np.int64).reshape(-1, 128)
        assert np.all(ids == ids[:, :1]), "a named barrier id differs inside a warpgroup"
        assert np.all((ids >= 1) & (ids < 16)) and self._uniform(count, "count") % 32 == 0

    bar_arrive_n = bar_sync_n

    def bar_sync_if(self, pred, bid, count):
        pred = self._vec(pred, np.uint32).reshape(-1, 128)
        assert np.all(pred == pred[:, :1]), "a named barrier predicate differs inside a warpgroup"
        self.bar_sync_n(bid, count)

    bar_arrive_if = bar_sync_if

    def stg_u32_if(self, pred, gaddr, x):
        pred = self._vec(pred, np.uint32) != 0
        gaddr = self._vec(gaddr, np.int64)[pred]
        if len(gaddr):
            self.mem.check(gaddr, 4)
            self.mem.buf[gaddr[:, None] + np.arange(4)] = self._vec(x, np.uint32)[pred][:, None].view(np.uint8).reshape(-1, 4)

    def stg_v2_if(self, pred, gaddr, x0, x1):
        pred = self._vec(pred, np.uint32) != 0
        gaddr = self._vec(gaddr, np.int64)[pred]
        if len(gaddr):
            assert np.all(gaddr % 8 == 0), "8-byte alignment of a vector store"
            self.mem.check(gaddr, 8)
            w = np.stack([self._vec(x, np.float32)[pred] for x in (x0, x1)], 1)
            self.mem.buf[gaddr[:, None] + np.arange(8)] = w.view(np.uint8).reshape(-1, 8)

    def stg_v4_if(self, pred, gaddr, x0, x1, x2, x3):
        pred = self._vec(pred, np.uint32) != 0
        gaddr = self._vec(gaddr, np.int64)[pred]
        if len(gaddr):
            assert np.all(gaddr % 16 == 0), "16-byte alignment of a vector store"
            self.mem.check(gaddr, 16)
            x = np.stack([self._vec(y, np.float32) for y in (x0, x1, x2, x3)], 1)[pred]
            self.mem.buf[gaddr[:, None] + np.arange(16)] = x.view(np.uint8).reshape(-1, 16)

    def stg_f32_if(self, pred, gaddr, x):
        self.stg_u32_if(pred, gaddr, self._vec(x, np.float32).view(np.uint32))

    def ldg_u32_if(self, pred, gaddr):
        pred = self._vec(pred, np.uint32) != 0
        gaddr = self._vec(gaddr, np.int64)
        out = np.zeros(self.NT, np.uint32)
        if pred.any():
            self.mem.check(gaddr[pred], 4)
            out[pred] = self.mem.buf[gaddr[pred][:, None] + np.arange(4)].view(np.uint32).ravel()
        return out

    def ldg_f32_if(self, pred, gaddr):
        return self.ldg_u32_if(pred, gaddr).view(np.float32)

    def ldg_v4_if(self, pred, gaddr):
        """16-byte load as four u32 per thread, zeros where the predicate is false."""
        pred = self._vec(pred, np.uint32) != 0
        gaddr = self._vec(gaddr, np.int64)
        out = np.zeros((4, self.NT), np.uint32)
        if pred.any():
            assert np.all(gaddr[pred] % 16 == 0), "16-byte alignment of a vector load"
            self.mem.check(gaddr[pred], 16)
            out[:, pred] = self.mem.buf[gaddr[pred][:, None] + np.arange(16)].view(np.uint32).reshape(-1, 4).T
        return tuple(out)

    def ldg_i32(self, gaddr):
        gaddr = int(gaddr)   # uniform
        self.mem.check(gaddr, 4)
        return np.int64(self.mem.buf[gaddr:gaddr + 4].view(np.int32)[0])

    # -- the fused backward's ordered dQ accumulation
    def wait_eq_if(self, pred, gaddr, value):
        """CTAs run one after another in launch order here, so the turn must already be ours:
        anything else is an ordering bug that would deadlock or race on a GPU."""
        if not np.any(self._vec(pred, np.uint32)):
            return
        got = int(self.ldg_i32(gaddr))
        if got != int(value):
            raise RuntimeError(f"dQ turn order violated: counter {got}, this CTA's turn {int(value)}")

    def _red_if(self, pred, gaddr, xs):
        pred = self._vec(pred, np.uint32) != 0
        gaddr = self._vec(gaddr, np.int64)[pred]
        n = len(xs)
        if len(gaddr):
            assert np.all(gaddr % (4 * n) == 0), "alignment of a vector red"
            self.mem.check(gaddr, 4 * n)
            x = np.stack([self._vec(y, np.float32) for y in xs], 1)[pred]
            idx = gaddr[:, None] + np.arange(4 * n)
            cur = self.mem.buf[idx].view(np.float32).reshape(-1, n)
            self.mem.buf[idx] = (cur + x).astype(np.float32).view(np.uint8).reshape(-1, 4 * n)

    def red_v2_if(self, pred, gaddr, x0, x1):
        self._red_if(pred, gaddr, (x0, x1))

    def red_v4_if(self, pred, gaddr, x0, x1, x2, x3):
        self._red_if(pred, gaddr, (x0, x1, x2, x3))

    def stg_release_if(self, pred, gaddr, value):
        self.stg_u32_if(pred, gaddr, np.uint32(int(value)))

    def _sts(self, addr, words, nbytes):
        addr = self._vec(addr, np.int64)
        assert np.all(addr % nbytes == 0), "alignment of a shared store"
        assert np.all((addr >= 0) & (addr + nbytes <= len(self.SM))), "shared access out of bounds"
        self.SM[addr[:, None] + np.arange(nbytes)] = words.view(np.uint8).reshape(self.NT, -1)[:, :nbytes]

    def sts_halves(self, addr_lo, addr_hi, x):
        x = self._vec(x, np.uint32)
        self._sts(addr_lo, (x & 0xFFFF).astype(np.uint16), 2)
        self._sts(addr_hi, (x >> 16).astype(np.uint16), 2)

    def sts_f32(self, addr, x):
        self._sts(addr, self._vec(x, np.float32), 4)

    def sts_v2(self, addr, x0, x1):
        self._sts(addr, np.stack([self._vec(x, np.float32) for x in (x0, x1)], 1), 8)

    def sts_u32x2(self, addr, x0, x1):
        self._sts(addr, np.stack([self._vec(x, np.uint32) for x in (x0, x1)], 1), 8)

    def sts_v4(self, addr, x0, x1, x2, x3):
        self._sts(addr, np.stack([self._vec(x, np.float32) for x in (x0, x1, x2, x3)], 1), 16)

    def lds_f32x4(self, addr):
        addr = self._smem16(addr)
        w = self.SM[addr[:, None] + np.arange(16)].view(np.float32)   # (NT, 4)
        return tuple(w[:, i].copy() for i in range(4))

    def lds_u32x4(self, addr):
        addr = self._smem16(addr)
        w = self.SM[addr[:, None] + np.arange(16)].view(np.uint32)   # (NT, 4)
        return tuple(w[:, i].copy() for i in range(4))

    def sts_u32x4(self, addr, x0, x1, x2, x3):
        self._sts(addr, np.stack([self._vec(x, np.uint32) for x in (x0, x1, x2, x3)], 1), 16)

    # -- registers
    def split3x2(self, a, b):
        """(hi, mid, lo) packed bf16x2 words of two f32 (ptx.split3x2: round to nearest even, exact
        f32 differences)."""
        words = []
        rest = [self._vec(x, np.float32) for x in (a, b)]
        for _ in range(3):
            bits = [f32_to_bits(x, "bfloat16") for x in rest]
            words.append((bits[0] | (bits[1] << 16)).astype(np.uint32))
            rest = [(x - bits_to_f32(u, "bfloat16")).astype(np.float32) for x, u in zip(rest, bits)]
        return tuple(words)

    def pack2(self, lo, hi):
        return (f32_to_bits(lo, self.dtype) | (f32_to_bits(hi, self.dtype) << 16)).astype(np.uint32)

    def unpack2(self, x):
        x = self._vec(x, np.uint32)
        return bits_to_f32(x, self.dtype), bits_to_f32(x >> 16, self.dtype)

    def shfl_xor(self, val, lm):
        return self._vec(val, np.float32)[np.arange(self.NT) ^ lm]


def _atleast(x, lo):
    """max.f32 (clamps.py): a NaN x gives lo."""
    return np.fmax(np.float32(x) if np.ndim(x) == 0 else x, np.float32(lo))


def _clampf(x, lo, hi):
    """max.f32 then min.f32 (ptx.clampf): a NaN x gives lo."""
    return np.fmin(_atleast(x, lo), np.float32(hi))


#: clamps.py's intrinsics (pure functions of their operands)
_CLAMPS = {"atleast": _atleast}
assert set(_CLAMPS) == set(clamps.NAMES)


def _sel(c, a, b):
    r = np.where(c, a, b)
    return r if r.ndim else r[()]


def _ex2(x):
    with np.errstate(over="ignore", under="ignore"):
        r = np.exp2(np.asarray(x, np.float32)).astype(np.float32)
    return np.where(np.abs(r) < np.float32(1.1754944e-38), np.float32(0), r)   # .ftz


#: `ex2(a * sc - b` in a kernel text: the GPU compiler contracts the product and the
#: difference into one fma (one rounding); numpy would round a * sc first. Rewritten to
#: `ex2(fms(a, sc, b)` so that the emulator rounds as the hardware does, which is what makes the
#: exponent of the row's largest score exactly the rounding error of m = a * sc.
_CONTRACTED = re.compile(r"ex2\((\w+) \* sc - (\w+)")


def _fms(a, b, c):
    """fma(a, b, -c) in float32: the float32 product is exact in float64 (48 bits), then one
    rounding of the difference to float64 and one to float32 (differs from a true fma only in
    double-rounding ties, ~2^-29 of cases)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) - np.asarray(c, np.float64)).astype(np.float32)


#: what a score modifier's text calls (generator/modifier.py), in float32 like libdevice's
_MATH = _types.SimpleNamespace(**{f: (lambda g: lambda x: g(np.float32(x) if np.ndim(x) == 0 else
                                                          np.asarray(x, np.float32)))(getattr(np, f))
                                  for f in ("tanh", "exp", "log", "sqrt")})


def _modifier_args(mem, mod, scale, H):
    """(sc, the modified kernels' trailing arguments) for `mod` = (Modifier, mv, mnd, mns) float32
    arrays in cuda/score_codegen.pack's layout, or (scale log2 e, ()) without a modifier."""
    if mod is None:
        return np.float32(scale * G.LOG2E), ()
    _, mv, mnd, mns = mod
    ptrs = tuple(mem.put(np.ascontiguousarray(a, np.float32).reshape(-1)) for a in (mv, mnd, mns))
    return np.float32(1.0), (np.float32(scale), H) + ptrs


#: the prelude line of a text using barriers.py, clamps.py or copies.py imports the GPU intrinsics; here the
#: Warps' own stand in
_INTRINSICS_IMPORT = re.compile(r"^from tiga_numba\.cuda\.tc\.(barriers|clamps|copies) import .*$", re.M)


def compile_source(src, name="<tc-emu>"):
    src = _INTRINSICS_IMPORT.sub("", src)
    code = compile(_CONTRACTED.sub(r"ex2(fms(\1, sc, \2)", src), name, "exec")
    return code


def launch(src, grid, NT, smem_bytes, mem, dtype, args):
    """Run the generated kernel over grid (gx, gy[, gz]) with NT threads per CTA."""
    code = compile_source(src)
    gz = grid[2] if len(grid) > 2 else 1
    for bx, by, bz in ((x, y, z) for z in range(gz) for y in range(grid[1]) for x in range(grid[0])):
        w = Warps(NT, smem_bytes, mem, dtype)
        cuda = _types.SimpleNamespace(
            threadIdx=_types.SimpleNamespace(x=np.arange(NT)),
            blockIdx=_types.SimpleNamespace(x=bx, y=by, z=bz),
            blockDim=_types.SimpleNamespace(x=NT),
            shared=_types.SimpleNamespace(array=lambda *a, **kw: None),
            syncthreads=lambda: None,
            syncthreads_or=lambda p: np.int32(np.any(np.asarray(p) != 0)),
            # the warps run in lockstep: a warp vote is taken over the CTA, which the kernels'
            # vote-guarded branches allow (their work is the identity where no lane needed it)
            any_sync=lambda mask, p: np.int32(np.any(np.asarray(p) != 0)))
        # fmaxf's NaN handling is the compiler's choice: np.maximum propagates a NaN, so a kernel
        # that relied on it passing over one fails here (clamps.atleast is max.f32: _atleast)
        env = dict(cuda=cuda, i64=lambda x: np.asarray(x, np.int64)[()], f32=np.float32, u8=np.uint8,
                   u32=lambda x: np.asarray(x, np.uint32)[()], fmaxf=np.maximum, imin=np.minimum, imax=np.maximum,
                   sel=_sel, ex2=_ex2, clampf=_clampf, fms=_fms, saddr=lambda a: np.uint32(0), log2f=np.log2,
                   bits_f32=lambda x: np.asarray(x, np.uint32).view(np.float32),
                   opq=lambda x: np.asarray(x, np.int64)[()],
                   a32=lambda x, y: ((np.asarray(x, np.int64) + np.asarray(y, np.int64)) & 0xFFFFFFFF)[()],
                   cp_commit=w.cp_commit, cp_wait0=lambda w=w: w.cp_wait(0), cp_wait1=lambda w=w: w.cp_wait(1),
                   math=_MATH)
        for nm in ("mma16816", "mma1688", "tf32x2", "lds64", "ldsm_x4", "ldsm_x4_t", "cp_async16",
                   "stg_u32_if", "stg_f32_if", "stg_v4_if", "stg_v2_if", "split3x2", "sts_u32x2", "ldg_u32_if", "ldg_f32_if", "ldg_v4_if", "ldg_i32", "pack2",
                   "unpack2", "shfl_xor", "wait_eq_if", "stg_release_if", "sts_halves", "sts_f32", "sts_v2", "sts_v4", "lds_f32x4", "lds_u32x4", "sts_u32x4", "red_v2_if", "red_v4_if") + barriers.NAMES + copies.NAMES:
            env[nm] = getattr(w, nm)
        env.update(_CLAMPS)
        env["fence_async"] = lambda: None
        env["wgmma_chain"] = lambda form, N, steps, wait=True, w=w: \
            lambda *args: w.wgmma_chain(form, N, steps, args, wait)
        env["wgmma_wait"] = lambda n, count, w=w: lambda *regs: w.wgmma_wait(n, count, regs)
        exec(code, env)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            env["kernel"](*args)
        assert not w.pending, "a wgmma chain was issued and never waited for"
        assert not any(b["landing"] for b in w.mbar.values()), "copies tracked by an mbarrier never waited for"


# ----------------------------------------------------------------------------- whole-op drivers
def _put_heads(mem, x, dtype):
    """store a node-major (N, H, D) array in the kernel's element type; returns (base, row stride,
    head stride) in bytes."""
    s = to_storage(x, dtype)
    base = mem.put(s)
    return base, s.strides[0], s.strides[1]


def forward(v, q, k, v_, dst_offsets, src_offsets, causal, scale, rho=None, stats=None, mod=None, lo=None, hi=None):
    """Emulate the forward on numpy inputs (any float dtype, rounded to v.dtype).
    Returns out (float32, rounded from the kernel's storage type), m, l. v.prune: admission
    threshold `rho`; `stats` (a dict) receives pruned_tiles / total_tiles as the API reports them,
    and m_kernel, the row max in the kernel's base-2 units (what the API's backward reads).
    lo / hi: the blocks' bands (BlockRelation.lo / hi), else full or square-causal blocks."""
    from . import schedule
    nd, H, D = q.shape
    ns, Hkv, Dv = v_.shape
    GB = v.GB   # output element bytes
    mem = Memory()
    qb, q_rs, q_hs = _put_heads(mem, q, v.dtype)
    kb, k_rs, k_hs = _put_heads(mem, k, v.dtype)
    vb, v_rs, v_hs = _put_heads(mem, v_, v.dtype)
    ob = mem.alloc(max(nd * H * Dv * GB, 1))
    mb = mem.alloc(max(nd * H * 4, 1))
    lb = mem.alloc(max(nd * H * 4, 1))
    mkb = mem.alloc(max(nd * H * 4, 1))
    work = schedule.query_tiles(dst_offsets, src_offsets, causal, v.BM, lo, hi)
    if len(work):
        wb = mem.put(work)
        sc, margs = _modifier_args(mem, mod, scale, H)
        cnt = mem.alloc(len(work) * H * 8) if v.prune else None
        args = (qb, kb, vb, ob, mb, lb, mkb, wb, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, H * Dv * GB, H // Hkv)
        args += ((cnt, sc, np.float32(-np.inf), np.float32(np.log2(rho))) if v.prune
                 else (sc, np.float32(-np.inf)) + margs)
        launch(G.gen_forward(v), (len(work), H), v.NT, v.smem_bytes(), mem, v.dtype, args)
        if v.prune and stats is not None:
            c = mem.get(cnt, np.uint32, (len(work) * H, 2)).astype(np.int64).sum(0)
            stats.update(pruned_tiles=int(c[0]), total_tiles=int(c[1]))
    if stats is not None:
        stats["m_kernel"] = mem.get(mkb, np.float32, (nd, H))
    out = from_storage(mem.get(ob, storage_dtype(v.dtype), (nd, H, Dv)), v.dtype)
    return out, mem.get(mb, np.float32, (nd, H)), mem.get(lb, np.float32, (nd, H))


def backward(vdq, vkv, dout, q, k, v_, out, m, l, dst_offsets, src_offsets, causal, scale,
             m_kernel=None, mod=None, lo=None, hi=None):
    """Emulate Delta pre-pass + dQ kernel + dK/dV kernel (vdq None: vkv.fuse_dq computes dQ too);
    returns dq, dk, dv as float32. m_kernel: the forward's base-2 row max (else m log2(e) in
    float32, as the API converts natural-log stats)."""
    from . import schedule
    schedule.check_ordered_fused(vkv, lo is None and hi is None)
    nd, H, D = q.shape
    ns, Hkv, Dv = v_.shape
    dt, GB, sd = vkv.dtype, vkv.GB, storage_dtype(vkv.dtype)
    mem = Memory()
    qb, q_rs, q_hs = _put_heads(mem, q, dt)
    kb, k_rs, k_hs = _put_heads(mem, k, dt)
    vb, v_rs, v_hs = _put_heads(mem, v_, dt)
    ob, o_rs, o_hs = _put_heads(mem, out, dt)
    db, do_rs, do_hs = _put_heads(mem, dout, dt)
    m2 = (np.asarray(m, np.float32) * np.float32(G.LOG2E) if m_kernel is None else m_kernel)
    mb = mem.put(np.ascontiguousarray(m2, np.float32))
    lb = mem.put(np.ascontiguousarray(l, np.float32))
    dlt = mem.alloc(max(nd * H * 4, 1))
    lse = mem.alloc(max(nd * H * 8, 1))   # (m2, log2 l) pairs
    dqb = mem.alloc(max(nd * H * D * GB, 1))
    dkb = mem.alloc(max(ns * Hkv * D * GB, 1))
    dvb = mem.alloc(max(ns * Hkv * Dv * GB, 1))
    sc, margs = _modifier_args(mem, mod, scale, H)
    if nd * H:
        ctas, threads = G.delta_grid(dt, Dv, nd * H)
        launch(G.gen_delta(dt, Dv), (ctas, 1), threads, 16, mem, dt,
               (ob, db, mb, lb, dlt, lse, nd, H, o_rs, o_hs, do_rs, do_hs))
    if vdq is not None:
        work = schedule.query_tiles(dst_offsets, src_offsets, causal, vdq.BM, lo, hi)
        if len(work):
            launch(G.gen_dq(vdq), (len(work), H), vdq.NT, vdq.smem_bytes(), mem, dt,
                   (qb, kb, vb, db, lse, dlt, dqb, mem.put(work), q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, do_rs, do_hs,
                    H * D * GB, H // Hkv, sc, np.float32(scale)) + margs)
    work = schedule.key_tiles(dst_offsets, src_offsets, causal, vkv.BM, lo, hi)
    if vkv.fuse_dq:
        # as the API does: rows no key tile visits are zero-filled, the rest stays poisoned
        unvisited = schedule.rows_without_keys(dst_offsets, src_offsets, nd, lo, hi)
        if unvisited.any():
            mem.buf[dqb:dqb + nd * H * D * GB].reshape(nd, -1)[unvisited] = 0
        # ordered: poisoned (the first visitor reads nothing); atomic: zeroed, converted below
        accb = mem.alloc(max(nd * H * D * 4, 1), fill=0 if vkv.dq_atomic else 0xFF)
        cntb = mem.alloc(max(nd * H * 4, 1), fill=0)         # turn counters start at 0
        if len(work):
            launch(G.gen_dkdv(vkv), (len(work) * Hkv, 1), vkv.NT, vkv.smem_bytes(), mem, dt,
                   (qb, kb, vb, db, lse, dlt, dkb, dvb, dqb, accb, cntb, mem.put(work), q_rs, q_hs, k_rs, k_hs,
                    v_rs, v_hs, do_rs, do_hs, Hkv * D * GB, Hkv * Dv * GB, H * D * GB, H // Hkv, H, sc,
                    np.float32(scale)))
    elif len(work):
        launch(G.gen_dkdv(vkv), (len(work), Hkv, vkv.col_parts), vkv.NT, vkv.smem_bytes(), mem, dt,
               (qb, kb, vb, db, lse, dlt, dkb, dvb, mem.put(work), q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, do_rs,
                do_hs, Hkv * D * GB, Hkv * Dv * GB, H // Hkv, H, sc, np.float32(scale)) + margs)
    # rows no work tile covers (sources outside every block) are zero by definition
    dq = from_storage(mem.get(dqb, sd, (nd, H, D)), dt)
    if vkv.fuse_dq and vkv.dq_atomic:   # the API's convert pass: dq = scale * accumulator in q's dtype
        acc = mem.get(accb, np.float32, (nd, H, D))
        dq = from_storage(to_storage((acc * np.float32(scale)).astype(np.float32), dt), dt)
    dk = from_storage(mem.get(dkb, sd, (ns, Hkv, D)), dt)
    dv = from_storage(mem.get(dvb, sd, (ns, Hkv, Dv)), dt)
    return dq, dk, dv

