"""Inline-PTX intrinsics for the tensor-core kernels (numba.cuda.extending.intrinsic).

Every intrinsic works on raw addresses (int64 global pointers, uint32 shared-window addresses)
and 32-bit registers, so the generated kernels take plain scalars: explicit launch signatures,
no array typing, and bfloat16 data needs no numba dtype. Built lazily (first GPU use) so the
emulator and the generator import without numba-cuda. Each intrinsic's warp-level meaning is
mirrored in emulator.py; keep the two in step.
"""
from __future__ import annotations

import zlib

_CACHE = {}

#: the element kinds the tensor-core path understands, with their PTX spellings (float32 runs as
#: 3xTF32: mma1688 on tf32 halves made by tf32x2; the 16-bit intrinsics are never used for it)
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}

#: wgmma (sm_90a): the N of m64nNk16 the generator uses (a warp's C tile is 16 x N); chains of
#: any length are made per kernel (wgmma_chain)
WGMMA_N = (16, 32, 64, 96, 128, 256)


def chain_operands(form, steps):
    """operands of a wgmma_chain call before its accumulators: ss / st (da, db); rs (4 registers per
    A group the steps use, then db)."""
    return 2 if form in ("ss", "st") else 4 * (max(g for g, _ in steps) + 1) + 1


def wgmma_operand(dtype):
    """the wgmma operand type of a kernel dtype: float32 runs on bf16 parts (generator "split")."""
    return "bf16" if dtype == "float32" else PTX_TYPE[dtype]


def intrinsics(dtype="float16"):
    """dict name -> numba intrinsic; `dtype` picks the mma operand type and the f32 -> x2 pack."""
    if dtype in _CACHE:
        return _CACHE[dtype]
    import llvmlite.ir as ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    pt = PTX_TYPE[dtype]
    I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    u32, i32, i64, f32 = types.uint32, types.int32, types.int64, types.float32

    def asm(bld, ret, argtys, text, cons, args, side_effect=True):
        fn = ir.FunctionType(ret, argtys)
        return bld.call(ir.InlineAsm(fn, text, cons, side_effect=side_effect), args)

    def tuple_of(ctx, bld, sig, r, n):
        out = ir.Constant(ctx.get_value_type(sig.return_type), ir.Undefined)
        for i in range(n):
            out = bld.insert_value(out, bld.extract_value(r, i), i)
        return out

    @intrinsic
    def mma16816(tc, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, u32, u32, f32, f32, f32, f32)

        def cg(ctx, bld, sig, args):
            r = asm(bld, ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4,
                    f"mma.sync.aligned.m16n8k16.row.col.f32.{pt}.{pt}.f32 "
                    "{$0,$1,$2,$3},{$4,$5,$6,$7},{$8,$9},{$10,$11,$12,$13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", args, side_effect=False)
            return tuple_of(ctx, bld, sig, r, 4)
        return sig, cg

    @intrinsic
    def mma1688(tc, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """C += A B on tf32 operands (m16n8k8): one pass of the 3xTF32 product."""
        sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, u32, u32, f32, f32, f32, f32)

        def cg(ctx, bld, sig, args):
            r = asm(bld, ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4,
                    "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                    "{$0,$1,$2,$3},{$4,$5,$6,$7},{$8,$9},{$10,$11,$12,$13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", args, side_effect=False)
            return tuple_of(ctx, bld, sig, r, 4)
        return sig, cg

    @intrinsic
    def tf32x2(tc, x):
        """fp32 (a float, or its bits as u32) -> (big, small) tf32 words with x ~= big + small to
        ~2^-22 relative: big = cvt.rna(x), small = cvt.rna(x - big). Inside one asm block, so
        fast-math cannot fold x - big away."""
        if x not in (f32, u32):
            return None
        sig = types.UniTuple(u32, 2)(x)

        def cg(ctx, bld, sig, args):
            a = args[0] if sig.args[0] == f32 else bld.bitcast(args[0], F32)
            r = asm(bld, ir.LiteralStructType([I32] * 2), [F32],
                    "{.reg .f32 d; cvt.rna.tf32.f32 $0, $2; mov.b32 d, $0; sub.f32 d, $2, d; "
                    "cvt.rna.tf32.f32 $1, d;}", "=r,=r,f", [a], side_effect=False)
            return tuple_of(ctx, bld, sig, r, 2)
        return sig, cg

    def predicated(op, kinds):
        """a store / reduction `op` to the global address gaddr of len(kinds) values ("r": u32,
        "f": f32), done only where pred != 0 (tail rows: no access at all): stg_u32_if,
        stg_f32_if, stg_v4_if (fp32 output rows), red_v2_if / red_v4_if (float atomic adds,
        unordered: the dq_atomic opt-in only)."""
        vals = "$2" if len(kinds) == 1 else "{" + ",".join(f"${i + 2}" for i in range(len(kinds))) + "}"
        text = "{.reg .pred p; setp.ne.u32 p, $0, 0; @p " + op + " [$1], " + vals + ";}"
        ir_tys = [I32, I64] + [F32 if c == "f" else I32 for c in kinds]
        nb_tys = [u32, i64] + [f32 if c == "f" else u32 for c in kinds]
        cons = "r,l," + ",".join(kinds) + ",~{memory}"

        def typer(tc, *args):
            def cg(ctx, bld, sig, args):
                asm(bld, ir.VoidType(), ir_tys, text, cons, args)
                return ctx.get_dummy_value()
            return types.void(*nb_tys), cg
        return named_intrinsic(f"pred_{op.replace('.', '_')}", len(nb_tys), typer)

    def named_intrinsic(name, nargs, typer):
        """numba's intrinsics take named parameters only (no *args): spell them out."""
        names = ", ".join(f"x{i}" for i in range(nargs))
        scope = {"typer": typer}
        exec(f"def {name}(tc, {names}):\n    return typer(tc, {names})\n", scope)
        return intrinsic(scope[name])

    def shared_load(op, kind, n):
        """n registers ("r": u32, "f": f32) loaded by `op` from one shared address: lds64 (fp32 B
        operands, no ldmatrix.trans), lds_f32x4, lds_u32x4 (the guard's raw bits), and ldmatrix.x4 (ldsm_x4, .trans: ldsm_x4_t)."""
        ty, nb = (I32, u32) if kind == "r" else (F32, f32)
        text = f"{op} {{" + ",".join(f"${i}" for i in range(n)) + f"}}, [${n}];"
        cons = ",".join([f"={kind}"] * n) + ",r,~{memory}"

        def typer(tc, addr):
            def cg(ctx, bld, sig, args):
                return tuple_of(ctx, bld, sig, asm(bld, ir.LiteralStructType([ty] * n), [I32], text, cons, args), n)
            return types.UniTuple(nb, n)(u32), cg
        return named_intrinsic(f"lds_{op.replace('.', '_')}", 1, typer)

    def shared_store(op, n, kind="f"):
        """n registers ("f": f32, "r": u32) stored by `op` at one shared address: sts_f32, sts_v2,
        sts_v4, sts_u32x2 (split's bf16 parts), sts_u32x4 (the guard's zeroed chunks)."""
        vals = "$1" if n == 1 else "{" + ",".join(f"${i + 1}" for i in range(n)) + "}"
        text = f"{op} [$0], {vals};"
        cons = "r," + ",".join([kind] * n) + ",~{memory}"
        ty, nb = (F32, f32) if kind == "f" else (I32, u32)

        def typer(tc, *args):
            def cg(ctx, bld, sig, args):
                asm(bld, ir.VoidType(), [I32] + [ty] * n, text, cons, args)
                return ctx.get_dummy_value()
            return types.void(u32, *[nb] * n), cg
        return named_intrinsic(f"sts_{op.replace('.', '_')}", n + 1, typer)

    @intrinsic
    def cp_async16(tc, saddr, gaddr, nbytes):
        """16-byte global -> shared copy; nbytes < 16 zero-fills the rest (0: a pure zero fill)."""
        sig = types.void(u32, i64, u32)

        def cg(ctx, bld, sig, args):
            asm(bld, ir.VoidType(), [I32, I64, I32], "cp.async.cg.shared.global [$0], [$1], 16, $2;",
                "r,l,r,~{memory}", args)
            return ctx.get_dummy_value()
        return sig, cg

    def nullary(text):
        @intrinsic
        def f(tc):
            sig = types.void()

            def cg(ctx, bld, sig, args):
                asm(bld, ir.VoidType(), [], text, "~{memory}", [])
                return ctx.get_dummy_value()
            return sig, cg
        return f

    @intrinsic
    def ldg_f32_if(tc, pred, gaddr):
        """predicated 4-byte float load, 0.0 when the predicate is false (no access made)."""
        sig = f32(u32, i64)

        def cg(ctx, bld, sig, args):
            return asm(bld, F32, [I32, I64],
                       "{.reg .pred p; setp.ne.u32 p, $1, 0; mov.f32 $0, 0f00000000; @p ld.global.f32 $0, [$2];}",
                       "=f,r,l,~{memory}", args)
        return sig, cg

    @intrinsic
    def ldg_u32_if(tc, pred, gaddr):
        sig = u32(u32, i64)

        def cg(ctx, bld, sig, args):
            return asm(bld, I32, [I32, I64],
                       "{.reg .pred p; setp.ne.u32 p, $1, 0; mov.u32 $0, 0; @p ld.global.u32 $0, [$2];}",
                       "=r,r,l,~{memory}", args)
        return sig, cg

    @intrinsic
    def ldg_v4_if(tc, pred, gaddr):
        """predicated 16-byte read-only load (four u32), zeros when the predicate is false (no
        access made); the address must be 16-byte aligned."""
        sig = types.UniTuple(u32, 4)(u32, i64)

        def cg(ctx, bld, sig, args):
            r = asm(bld, ir.LiteralStructType([I32] * 4), [I32, I64],
                    "{.reg .pred p; setp.ne.u32 p, $4, 0; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; "
                    "mov.u32 $3, 0; @p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$5];}",
                    "=r,=r,=r,=r,r,l", args, side_effect=False)
            return tuple_of(ctx, bld, sig, r, 4)
        return sig, cg

    @intrinsic
    def bits_f32(tc, x):
        """the float32 whose bits are the u32 x (a register reinterpretation, no instruction)."""
        sig = f32(u32)

        def cg(ctx, bld, sig, args):
            return bld.bitcast(args[0], F32)
        return sig, cg

    @intrinsic
    def ldg_i32(tc, gaddr):
        sig = i32(i64)

        def cg(ctx, bld, sig, args):
            return asm(bld, I32, [I64], "ld.global.nc.s32 $0, [$1];", "=r,l", args, side_effect=False)
        return sig, cg

    @intrinsic
    def pack2(tc, lo, hi):
        """two f32 -> one x2 register (lo in bits 0..15): PTX puts its first source in the upper half."""
        sig = u32(f32, f32)

        def cg(ctx, bld, sig, args):
            return asm(bld, I32, [F32, F32], f"cvt.rn.{pt}x2.f32 $0, $2, $1;", "=r,f,f", args, side_effect=False)
        return sig, cg

    @intrinsic
    def unpack2(tc, x):
        """one x2 register -> two f32 (lo, hi)."""
        sig = types.UniTuple(f32, 2)(u32)

        def cg(ctx, bld, sig, args):
            if pt == "f16":
                text = ("{.reg .b16 a, b; mov.b32 {a, b}, $2; cvt.f32.f16 $0, a; cvt.f32.f16 $1, b;}")
            else:  # bf16 -> f32 is a 16-bit shift
                text = "{shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000;}"
            r = asm(bld, ir.LiteralStructType([F32] * 2), [I32], text, "=f,=f,r", args, side_effect=False)
            return tuple_of(ctx, bld, sig, r, 2)
        return sig, cg

    @intrinsic
    def ex2(tc, x):
        sig = f32(f32)

        def cg(ctx, bld, sig, args):
            return asm(bld, F32, [F32], "ex2.approx.ftz.f32 $0, $1;", "=f,f", args, side_effect=False)
        return sig, cg

    @intrinsic
    def clampf(tc, x, lo, hi):
        """min(max(x, lo), hi) on max.f32 / min.f32: two instructions, and NaN gives lo (PTX's
        max returns the other operand of a NaN); a compare-and-select pair per bound took four."""
        sig = f32(f32, f32, f32)

        def cg(ctx, bld, sig, args):
            return asm(bld, F32, [F32, F32, F32], "{max.f32 $0, $1, $2; min.f32 $0, $0, $3;}",
                       "=f,f,f,f", args, side_effect=False)
        return sig, cg

    @intrinsic
    def saddr(tc, arr):
        """shared-window (32-bit) address of a cuda.shared.array."""
        sig = u32(arr)

        def cg(ctx, bld, sig, args):
            ary = ctx.make_array(sig.args[0])(ctx, bld, args[0])
            p = bld.ptrtoint(ary.data, I64)
            return asm(bld, I32, [I64], "{.reg .u64 t; cvta.to.shared.u64 t, $1; cvt.u32.u64 $0, t;}", "=r,l", [p],
                       side_effect=False)
        return sig, cg

    @intrinsic
    def shfl_xor(tc, x, lanemask):
        """butterfly shuffle of a float across the full warp (every lane must call it)."""
        sig = f32(f32, i32)

        def cg(ctx, bld, sig, args):
            return asm(bld, F32, [F32, I32], "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=f,f,r", args)
        return sig, cg

    @intrinsic
    def sel(tc, c, a, b):
        """branch-free select (LLVM select): the generated code never branches on per-lane data."""
        ty = a if a == b else tc.unify_types(a, b)
        if ty is None:
            return None
        sig = ty(c, a, b)

        def cg(ctx, bld, sig, args):
            cond = ctx.cast(bld, args[0], sig.args[0], types.boolean)
            x = ctx.cast(bld, args[1], sig.args[1], sig.return_type)
            y = ctx.cast(bld, args[2], sig.args[2], sig.return_type)
            return bld.select(cond, x, y)
        return sig, cg

    @intrinsic
    def opq(tc, x):
        """an opaque 64-bit copy: LLVM cannot hoist what depends on it out of a loop."""
        sig = i64(i64)

        def cg(ctx, bld, sig, args):
            return asm(bld, I64, [I64], "mov.b64 $0, $1;", "=l,l", args)
        return sig, cg

    @intrinsic
    def a32(tc, x, y):
        """32-bit add of two integers (truncated first): shared-window address arithmetic."""
        if not isinstance(x, types.Integer) or not isinstance(y, types.Integer):
            return None
        sig = u32(x, y)

        def cg(ctx, bld, sig, args):
            a = ctx.cast(bld, args[0], sig.args[0], u32)
            b = ctx.cast(bld, args[1], sig.args[1], u32)
            return bld.add(a, b)
        return sig, cg

    # -- the fused backward's ordered dQ accumulation (generator.fetch_acc / flush_dq): a turn
    #    counter per (query block, head), acquire/release at GPU scope
    @intrinsic
    def wait_eq_if(tc, pred, gaddr, value):
        """where pred: spin until the u32 at gaddr equals value (ld.acquire.gpu: what the releasing
        CTA wrote before its release is visible after it; one thread spins, a CTA barrier follows).
        Labels are local to the { } scope."""
        sig = types.void(u32, i64, i64)

        def cg(ctx, bld, sig, args):
            v32 = bld.trunc(args[2], I32)
            asm(bld, ir.VoidType(), [I32, I64, I32],
                "{.reg .pred p, q; .reg .u32 x; setp.eq.u32 q, $0, 0; @q bra TIGA_DONE; "
                "TIGA_WAIT: ld.acquire.gpu.global.u32 x, [$1]; setp.ne.u32 p, x, $2; @p bra TIGA_WAIT; "
                "TIGA_DONE: }", "r,l,r,~{memory}", [args[0], args[1], v32])
            return ctx.get_dummy_value()
        return sig, cg

    @intrinsic
    def stg_release_if(tc, pred, gaddr, value):
        """predicated st.release.gpu of a u32 (the turn counter: after a CTA barrier, so it publishes
        every thread's accumulator stores, PTX release cumulativity)."""
        sig = types.void(u32, i64, i64)

        def cg(ctx, bld, sig, args):
            asm(bld, ir.VoidType(), [I32, I64, I32],
                "{.reg .pred p; setp.ne.u32 p, $0, 0; @p st.release.gpu.global.u32 [$1], $2;}",
                "r,l,r,~{memory}", [args[0], args[1], bld.trunc(args[2], I32)])
            return ctx.get_dummy_value()
        return sig, cg

    @intrinsic
    def sts_halves(tc, addr_lo, addr_hi, x):
        """store the two 16-bit halves of a packed x2 register at two shared addresses (a C
        fragment written transposed: dS^T -> dS)."""
        sig = types.void(u32, u32, u32)

        def cg(ctx, bld, sig, args):
            asm(bld, ir.VoidType(), [I32, I32, I32],
                "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $2; st.shared.b16 [$0], lo; st.shared.b16 [$1], hi;}",
                "r,r,r,~{memory}", args)
            return ctx.get_dummy_value()
        return sig, cg

    @intrinsic
    def split3x2(tc, a, b):
        """two f32 -> three packed bf16x2 words (hi, mid, lo) with x = hi + mid + lo + O(2^-24 |x|):
        hi = rn(x), mid = rn(x - hi), lo = rn(x - hi - mid); a in the low halves. The differences
        are exact in f32. One asm block, so fast-math cannot fold x - hi away."""
        sig = types.UniTuple(u32, 3)(f32, f32)

        def cg(ctx, bld, sig, args):
            rest = ("shl.b32 t, {p}, 16; mov.b32 xa, t; sub.rn.f32 ra, ra, xa; "
                    "and.b32 t, {p}, 0xffff0000; mov.b32 xb, t; sub.rn.f32 rb, rb, xb; ")
            r = asm(bld, ir.LiteralStructType([I32] * 3), [F32, F32],
                    "{.reg .b32 t; .reg .f32 ra, rb, xa, xb; mov.f32 ra, $3; mov.f32 rb, $4; "
                    "cvt.rn.bf16x2.f32 $0, rb, ra; " + rest.format(p="$0")
                    + "cvt.rn.bf16x2.f32 $1, rb, ra; " + rest.format(p="$1")
                    + "cvt.rn.bf16x2.f32 $2, rb, ra;}", "=&r,=&r,=r,f,f", args, side_effect=False)
            return tuple_of(ctx, bld, sig, r, 3)
        return sig, cg

    def wgmma_chain(form, N, steps, wait=True):
        """one whole warpgroup product in one asm block: wgmma.fence, a chain of
        wgmma.mma_async.m64n{N}k16, commit, wait. `steps` (compile-time, one per instruction):
        form "ss": (A offset, B offset), A and B K-major in shared memory, the descriptors being
        the base descriptors da, db plus the offsets (16-byte units); form "st": as "ss" but B
        MN-major (imm-trans-b = 1: the fused dQ = dS K); form "rs": (A group, B offset),
        A from registers (group g = registers 4g .. 4g + 3 of the A operands passed), B from
        shared memory, MN-major (imm-trans-b = 1). Each step's descriptors are made by an add
        inside the block, right before their instruction: computed outside, every descriptor of a
        long chain (float32's 6 passes: up to 96) would be live at once. Waiting inside the block
        keeps the asynchronous accumulators out of LLVM's hands: nothing reads or moves them
        between issue and completion. The accumulators are tied in/out operands.
        wait=False issues and commits the chain without waiting: its outputs are not the results
        yet, and the program must not touch them before a wgmma_wait that ties them (the generator
        overlaps the chain with CUDA-core work that way; the emulator poisons them until the wait).
        Arguments: ss / st (da, db, *acc); rs (*a_regs, db, *acc)."""
        n = N // 2
        ss = form in ("ss", "st")
        na = chain_operands(form, steps)
        lines = [f".reg .b64 ta<{len(steps)}>, tb<{len(steps)}>;", "wgmma.fence.sync.aligned;"]
        acc = "{" + ", ".join(f"${i}" for i in range(n)) + "}"
        for i, (a, b) in enumerate(steps):
            lines.append(f"add.s64 tb{i}, ${n + na - 1}, {b};")
            if ss:
                lines.append(f"add.s64 ta{i}, ${n}, {a};")
                lines.append(f"wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{wt}.{wt} {acc}, ta{i}, tb{i}, "
                             f"1, 1, 1, 0, {int(form == 'st')};")
            else:
                regs = "{" + ", ".join(f"${n + 4 * a + r}" for r in range(4)) + "}"
                lines.append(f"wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{wt}.{wt} {acc}, {regs}, tb{i}, "
                             "1, 1, 1, 1;")
        lines += ["wgmma.commit_group.sync.aligned;"] + (["wgmma.wait_group.sync.aligned 0;"] if wait else [])
        text = "{\n" + "\n".join(lines) + "\n}"
        in_tys = ([i64, i64] if ss else [u32] * (na - 1) + [i64]) + [f32] * n
        ir_tys = ([I64, I64] if ss else [I32] * (na - 1) + [I64]) + [F32] * n
        cons = ",".join(["=f"] * n + (["l", "l"] if ss else ["r"] * (na - 1) + ["l"])
                        + [str(i) for i in range(n)]) + ",~{memory}"

        def typer(tc, *args):
            sig = types.UniTuple(f32, n)(*in_tys)

            def cg(ctx, bld, sig, args):
                r = asm(bld, ir.LiteralStructType([F32] * n), ir_tys, text, cons, args)
                return tuple_of(ctx, bld, sig, r, n)
            return sig, cg
        return named_intrinsic(f"wgmma_{form}_{N}_{zlib.crc32(repr(steps).encode()):08x}" + ("" if wait else "_nw"),
                               len(in_tys), typer)

    def wgmma_wait(n, count):
        """wgmma.wait_group n: at most n committed chains still in flight. The `count` accumulators
        of the chain that completed pass through as tied operands, so the program reads them only
        after the wait (and LLVM sees them redefined here)."""
        cons = ",".join(["=f"] * count + [str(i) for i in range(count)]) + ",~{memory}"

        def typer(tc, *args):
            sig = types.UniTuple(f32, count)(*([f32] * count))

            def cg(ctx, bld, sig, args):
                r = asm(bld, ir.LiteralStructType([F32] * count), [F32] * count,
                        f"wgmma.wait_group.sync.aligned {n};", cons, args)
                return tuple_of(ctx, bld, sig, r, count)
            return sig, cg
        return named_intrinsic(f"wgmma_wait_{n}_{count}", count, typer)

    wt = wgmma_operand(dtype)
    wg = dict(wgmma_chain=wgmma_chain, wgmma_wait=wgmma_wait)
    wg["fence_async"] = nullary("fence.proxy.async.shared::cta;")

    _CACHE[dtype] = dict(shfl_xor=shfl_xor, sel=sel, a32=a32, opq=opq,
        mma16816=mma16816, mma1688=mma1688, tf32x2=tf32x2, lds64=shared_load("ld.shared.v2.u32", "r", 2),
        ldsm_x4=shared_load("ldmatrix.sync.aligned.m8n8.x4.shared.b16", "r", 4),
        ldsm_x4_t=shared_load("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "r", 4), cp_async16=cp_async16,
        cp_commit=nullary("cp.async.commit_group;"), cp_wait0=nullary("cp.async.wait_group 0;"),
        cp_wait1=nullary("cp.async.wait_group 1;"),
        stg_u32_if=predicated("st.global.u32", "r"), stg_f32_if=predicated("st.global.f32", "f"),
        stg_v4_if=predicated("st.global.v4.f32", "ffff"), stg_v2_if=predicated("st.global.v2.f32", "ff"),
        split3x2=split3x2, sts_u32x2=shared_store("st.shared.v2.u32", 2, "r"),
        red_v2_if=predicated("red.global.add.v2.f32", "ff"), red_v4_if=predicated("red.global.add.v4.f32", "ffff"),
        ldg_f32_if=ldg_f32_if, ldg_u32_if=ldg_u32_if, ldg_v4_if=ldg_v4_if, bits_f32=bits_f32, ldg_i32=ldg_i32, pack2=pack2, unpack2=unpack2,
        ex2=ex2, clampf=clampf, saddr=saddr, wait_eq_if=wait_eq_if, stg_release_if=stg_release_if,
        sts_halves=sts_halves, sts_f32=shared_store("st.shared.f32", 1),
        sts_v2=shared_store("st.shared.v2.f32", 2), sts_v4=shared_store("st.shared.v4.f32", 4),
        lds_f32x4=shared_load("ld.shared.v4.f32", "f", 4),
        lds_u32x4=shared_load("ld.shared.v4.u32", "r", 4), sts_u32x4=shared_store("st.shared.v4.u32", 4, "r"), **wg)
    return _CACHE[dtype]
