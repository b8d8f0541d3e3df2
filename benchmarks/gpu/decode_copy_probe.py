"""How fast can a decode-shaped kernel stream K and V at all? Copy-only kernels with the split-key
decode kernel's grid and per-warp walk (fp16, Hkv = 8, D = 128, token-major K / V of
(keys, Hkv, D), 16 key chunks x 8 kv heads = 128 CTAs), each reading every K and V row of its
chunk once into shared memory (or registers) and doing nothing with it but a checksum:

  cp.async S2      the decode kernel's ring: 16-byte cp.async per lane, two steps per warp
                   (K16: 16 keys per warp step; L2::128B / L2::256B: the copies' L2 prefetch hint)
  bulk S2 / S3     cp.async.bulk: one 256-byte bulk copy per K / V row (a lane per key),
                   completion on an mbarrier per stage (expect_tx), two or three stages per warp
  ldg.nc           16-byte read-only loads into registers, no shared memory
  decode           the package's decode forward on the same arrays (tg.attention)

GPU time per launch back to back (CUDA events over 20 launches), and the K + V read rate.

    python benchmarks/gpu/decode_copy_probe.py [--keys 131072] [--warps 4,8]
"""
import argparse

import cupy
import numba
import numpy as np
from numba import cuda

import tiga_numba as tg
from tiga_numba.cuda.common import nbtype
from tiga_numba.cuda.launch import Kernel, array_view, current_stream
from tiga_numba.cuda.tc.barriers import intrinsics as barriers
from tiga_numba.cuda.tc.ptx import intrinsics

U32 = numba.uint32
I64 = numba.int64
SU32 = nbtype("uint32")
SU64 = nbtype("int64")
HKV, D = 8, 128
ROW = 2 * D  # bytes per K / V row of one kv head
ROWP = ROW + 16


def bulk_intrinsics():
    import llvmlite.ir as ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic
    I32, I64_ = ir.IntType(32), ir.IntType(64)

    @intrinsic
    def bulk_copy(tc, saddr, gaddr, mbar):
        """one ROW-byte bulk copy global -> shared, completing tx bytes on mbarrier mbar"""
        sig = types.void(types.uint32, types.int64, types.uint32)

        def cg(ctx, bld, sig, args):
            fn = ir.FunctionType(ir.VoidType(), [I32, I64_, I32])
            bld.call(ir.InlineAsm(fn, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                                      f"[$0], [$1], {ROW}, [$2];", "r,l,r,~{memory}", side_effect=True), args)
            return ctx.get_dummy_value()
        return sig, cg

    @intrinsic
    def arrive_expect(tc, mbar, nbytes):
        sig = types.void(types.uint32, types.uint32)

        def cg(ctx, bld, sig, args):
            fn = ir.FunctionType(ir.VoidType(), [I32, I32])
            bld.call(ir.InlineAsm(fn, "{.reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1;}",
                                  "r,r,~{memory}", side_effect=True), args)
            return ctx.get_dummy_value()
        return sig, cg
    return bulk_copy, arrive_expect


def cp_async_hinted(hint):
    """16-byte cp.async.cg with an L2 prefetch-size hint ("" for none: ptx.py's cp_async16)"""
    import llvmlite.ir as ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def cp16(tc, saddr, gaddr, nbytes):
        sig = types.void(types.uint32, types.int64, types.uint32)

        def cg(ctx, bld, sig, args):
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64), ir.IntType(32)])
            bld.call(ir.InlineAsm(fn, f"cp.async.cg.shared.global{hint} [$0], [$1], 16, $2;",
                                  "r,l,r,~{memory}", side_effect=True), args)
            return ctx.get_dummy_value()
        return sig, cg
    return cp16


def make_cp_async(NW, KEYS, hint=""):
    """the decode kernel's copy ring alone: two steps of KEYS keys per warp, as shipped"""
    ptx = intrinsics("float16")
    cp16, commit, wait1, saddr = ptx["cp_async16"], ptx["cp_commit"], ptx["cp_wait1"], ptx["saddr"]
    if hint:
        cp16 = cp_async_hinted(hint)
    CPR = ROW // 16
    RPC = 32 // CPR
    NCP = KEYS * CPR // 32
    TILE = KEYS * ROWP
    AS_U = array_view(numba.uint32)

    def body(k_p, v_p, out_p, chunk):
        out = AS_U(out_p)
        sv = cuda.shared.array(0, SU32)
        c = I64(cuda.blockIdx.x)
        hk = I64(cuda.blockIdx.y)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        wbase = saddr(sv) + U32(warp * 2 * 2 * TILE)
        cb = c * chunk
        ce = cb + chunk
        kl = k_p + 2 * ((lane // CPR) * HKV * D + hk * D + 8 * (lane % CPR))
        vl = v_p + 2 * ((lane // CPR) * HKV * D + hk * D + 8 * (lane % CPR))
        rs = 2 * HKV * D
        sa = U32((lane // CPR) * ROWP + 16 * (lane % CPR))
        first = cb + warp * KEYS
        stride = NW * KEYS
        # first step
        ka = kl + first * rs
        va = vl + first * rs
        for i in range(NCP):
            cp16(wbase + sa + U32(i * RPC * ROWP), ka + i * RPC * rs, U32(16))
            cp16(wbase + sa + U32(TILE + i * RPC * ROWP), va + i * RPC * rs, U32(16))
        commit()
        buf = 0
        acc = U32(0)
        for js in range(first, ce, stride):
            nx = js + stride
            if nx < ce:
                ka = kl + nx * rs
                va = vl + nx * rs
                tb = wbase + U32((1 - buf) * 2 * TILE)
                for i in range(NCP):
                    cp16(tb + sa + U32(i * RPC * ROWP), ka + i * RPC * rs, U32(16))
                    cp16(tb + sa + U32(TILE + i * RPC * ROWP), va + i * RPC * rs, U32(16))
            commit()
            wait1()
            cuda.syncwarp()
            o = (warp * 2 * 2 * TILE + buf * 2 * TILE) // 4
            if lane < KEYS:
                acc ^= sv[o + lane * (ROWP // 4)] ^ sv[o + TILE // 4 + lane * (ROWP // 4)]
            cuda.syncwarp()
            buf = 1 - buf
        out[(c * HKV + hk) * NW * 32 + tid] = acc

    kern = Kernel(f"probe_cpasync_nw{NW}_k{KEYS}{hint.replace(':', '').replace('.', '_')}", body,
                  [("k", "s", I64), ("v", "s", I64), ("out", "a", numba.uint32), ("chunk", "s", I64)])
    kern.dyn_smem = NW * 2 * 2 * TILE
    return kern


def make_bulk(NW, KEYS, S):
    """one bulk copy per K / V row (a lane per key), S stages per warp on mbarriers"""
    ptx = intrinsics("float16")
    saddr = ptx["saddr"]
    b = barriers()
    init_if, init_fence, wait = b["mbar_init_if"], b["mbar_init_fence"], b["mbar_wait"]
    bulk_copy, arrive_expect = bulk_intrinsics()
    assert KEYS == 32
    TILE = KEYS * ROWP
    NBAR = NW * S
    AS_U = array_view(numba.uint32)

    def body(k_p, v_p, out_p, chunk):
        out = AS_U(out_p)
        sv = cuda.shared.array(0, SU32)
        bars = cuda.shared.array(NBAR, SU64)
        c = I64(cuda.blockIdx.x)
        hk = I64(cuda.blockIdx.y)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        wbase = saddr(sv) + U32(warp * S * 2 * TILE)
        bbase = saddr(bars) + U32(8 * warp * S)
        for s in range(S):
            init_if(U32(1 if lane == 0 else 0), bbase + U32(8 * s), U32(1))
        init_fence()
        cuda.syncwarp()
        cb = c * chunk
        ce = cb + chunk
        rs = 2 * HKV * D
        kl = k_p + 2 * (lane * HKV * D + hk * D)
        vl = v_p + 2 * (lane * HKV * D + hk * D)
        first = cb + warp * KEYS
        stride = NW * KEYS
        nsteps = (ce - first + stride - 1) // stride
        acc = U32(0)
        # step i waits for its stage; the step S - 1 ahead is issued first (the first S - 1
        # iterations only issue)
        for i in range(1 - S, nsteps):
            nx = i + S - 1
            if nx < nsteps:
                st = nx % S
                bar = bbase + U32(8 * st)
                js = first + nx * stride
                if lane == 0:
                    arrive_expect(bar, U32(2 * KEYS * ROW))
                cuda.syncwarp()
                t = wbase + U32(st * 2 * TILE + lane * ROWP)
                bulk_copy(t, kl + js * rs, bar)
                bulk_copy(t + U32(TILE), vl + js * rs, bar)
            if i < 0:
                continue
            st = i % S
            wait(bbase + U32(8 * st), U32((i // S) & 1))
            o = (warp * S * 2 * TILE + st * 2 * TILE) // 4
            acc ^= sv[o + lane * (ROWP // 4)] ^ sv[o + TILE // 4 + lane * (ROWP // 4)]
            cuda.syncwarp()
        out[(c * HKV + hk) * NW * 32 + tid] = acc

    kern = Kernel(f"probe_bulk_nw{NW}_k{KEYS}_s{S}", body,
                  [("k", "s", I64), ("v", "s", I64), ("out", "a", numba.uint32), ("chunk", "s", I64)])
    kern.dyn_smem = NW * S * 2 * TILE
    return kern


def make_ldg(NW, KEYS):
    """16-byte read-only loads into registers: lane l reads 16 bytes of row l // 16"""
    ptx = intrinsics("float16")
    ldg = ptx["ldg_v4_if"]
    AS_U = array_view(numba.uint32)
    CPR = ROW // 16
    RPC = 32 // CPR

    def body(k_p, v_p, out_p, chunk):
        out = AS_U(out_p)
        c = I64(cuda.blockIdx.x)
        hk = I64(cuda.blockIdx.y)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        cb = c * chunk
        ce = cb + chunk
        rs = 2 * HKV * D
        kl = k_p + 2 * ((lane // CPR) * HKV * D + hk * D + 8 * (lane % CPR))
        vl = v_p + 2 * ((lane // CPR) * HKV * D + hk * D + 8 * (lane % CPR))
        acc = U32(0)
        for js in range(cb + warp * KEYS, ce, NW * KEYS):
            for h in range(2):
                a0 = U32(0)
                for i in range(KEYS // RPC // 2):
                    kk = js + (h * KEYS // RPC // 2 + i) * RPC
                    x = ldg(U32(1), kl + kk * rs)
                    y = ldg(U32(1), vl + kk * rs)
                    a0 ^= x[0] ^ x[1] ^ x[2] ^ x[3] ^ y[0] ^ y[1] ^ y[2] ^ y[3]
                acc ^= a0
        out[(c * HKV + hk) * NW * 32 + tid] = acc

    return Kernel(f"probe_ldg_nw{NW}_k{KEYS}", body,
                  [("k", "s", I64), ("v", "s", I64), ("out", "a", numba.uint32), ("chunk", "s", I64)])


def gpu_time(fn, n=20):
    fn()
    cupy.cuda.Device().synchronize()
    s, e = cupy.cuda.Event(), cupy.cuda.Event()
    best = None
    for _ in range(3):
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        t = cupy.cuda.get_elapsed_time(s, e) / 1e3 / n
        best = t if best is None else min(best, t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=131072)
    ap.add_argument("--warps", default="4,8")
    a = ap.parse_args()
    L = a.keys
    splits = 16
    chunk = L // splits
    rng = np.random.default_rng(0)
    k = cupy.asarray(rng.standard_normal((L, HKV, D)).astype(np.float16))
    v = cupy.asarray(rng.standard_normal((L, HKV, D)).astype(np.float16))
    q = cupy.asarray(rng.standard_normal((1, 32, D)).astype(np.float16))
    nbytes = 2 * L * HKV * D * 2
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# {name}; {L} keys, Hkv {HKV}, D {D}, fp16 token-major; grid ({splits} chunks, {HKV} heads); "
          f"K + V {nbytes / 1e6:.0f} MB; GPU time per launch back to back (best of 3 x 20)")
    stream = current_stream()
    for nw in (int(x) for x in a.warps.split(",")):
        out = cupy.zeros(splits * HKV * nw * 32, np.uint32)
        variants = [("cp.async S2", make_cp_async(nw, 32)),
                    ("cp.async S2 K16", make_cp_async(nw, 16)),
                    ("cp.async S2 L2::128B", make_cp_async(nw, 32, ".L2::128B")),
                    ("cp.async S2 L2::256B", make_cp_async(nw, 32, ".L2::256B")),
                    ("bulk S2", make_bulk(nw, 32, 2)),
                    ("bulk S3", make_bulk(nw, 32, 3)), ("ldg.nc", make_ldg(nw, 32))]
        for label, kern in variants:
            if kern.dyn_smem > 227 * 1024:
                print(f"NW{nw} {label:<20} skipped: {kern.dyn_smem} B of shared memory")
                continue
            try:
                def run():
                    kern((splits, HKV, 1), (nw * 32, 1, 1), stream, k.data.ptr, v.data.ptr,
                         out.data.ptr, chunk)
                t = gpu_time(run)
                print(f"NW{nw} {label:<20} {t * 1e3:7.3f} ms  {nbytes / t / 1e12:5.2f} TB/s  "
                      f"checksum {int(np.bitwise_xor.reduce(cupy.asnumpy(out)))}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"NW{nw} {label:<20} {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    g = tg.Graph.dense(L, 1)
    t = gpu_time(lambda: tg.attention(q, k, v, g))
    print(f"decode (tg.attention)  {t * 1e3:7.3f} ms  {nbytes / t / 1e12:5.2f} TB/s  "
          f"[{tg.functional.last_plan().run_info['kernel'][-80:]}]")
    t = gpu_time(lambda: cupy.copyto(k, v))
    print(f"cupy copy K <- V       {t * 1e3:7.3f} ms  {2 * nbytes / 2 / t / 1e12:5.2f} TB/s read+write")


if __name__ == "__main__":
    main()
