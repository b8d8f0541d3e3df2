"""Inline-PTX operations of the score-modifier kernels (sm_80+): a clamp with one bound, for a
modified score with a static bound above (generator/modifier.py), and an exp2 on the FMA pipe, for
the share of the online softmax's exponentials that the SFU should not take (generator/softmax.py).

Kept apart from ptx.py for the reason barriers.py and copies.py are: a kernel text that calls them
imports this module in its own prelude line (`prelude_line`), which carries this file's digest,
so editing it re-keys the cubins of exactly those kernels. Mirrored in emulator.py (`_atleast`,
`_ex2_fma`); keep the two in step.

`atleast(x, lo)`: max.f32(x, lo): x where x >= lo, lo where x < lo or x is NaN (PTX's max returns
the other operand of a NaN). One instruction; ptx.clampf is this followed by min.f32.

`ex2_fma(x)`: 2^x for x <= 0 without the SFU: x = n + f with n = round(x) (the 1.5 2^23 rounding
add) and |f| <= 1/2, 2^f by a degree-5 polynomial (five fma: relative error 1.7e-7, ex2.approx's
class; exact at the integers), n added to the result's exponent field (shl, add.s32); x < -126 (or NaN) gives 0, as
ex2.approx.ftz gives 0 below 2^-126. Eleven FMA / ALU instructions for one SFU instruction: worth it
only where the SFU, not the issue slots, bounds the softmax (a soft-cap's tanh takes one SFU
instruction per score too). x above 127 is not handled (the softmax's exponents are at most 0).
"""
from __future__ import annotations

import hashlib
import inspect

_CACHE = []

#: the names this module provides to a kernel text (and emulator.py mirrors)
NAMES = ("atleast", "ex2_fma")

#: 2^f on [-1/2, 1/2], coefficients of f^0 .. f^5 (float32; a relative-error minimax fit with
#: the constant term 1, so that 2^n is exact at every integer n: the row maximum's weight is 1)
EX2_POLY = (1.0, 0.6931470036506653, 0.24022242426872253, 0.05550733581185341,
            0.009671507403254509, 0.0013264709850773215)
#: the rounding constant 1.5 2^23 (x + it holds round(x) in its low mantissa bits)
EX2_ROUND = 12582912.0
#: below this the result is 0 (ex2.approx.ftz: results under 2^-126 flush to 0)
EX2_FLOOR = -126.0


def digest():
    """sha1 prefix of this module's source: part of every prelude_line, hence of the cubin key."""
    import sys
    return hashlib.sha1(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:16]


def prelude_line():
    """the module-level line a kernel text that uses these intrinsics starts with."""
    return (f"from tiga_numba.cuda.tc.cell_ops import intrinsics as _cell_ops; "
            f"globals().update(_cell_ops())  # cell_ops {digest()}")


def _hex(x):
    """a float32 constant as PTX writes it (0fXXXXXXXX)."""
    import struct
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


def _ex2_fma_asm():
    c = [_hex(x) for x in EX2_POLY]
    return ("{ .reg .f32 t, n, f, p; .reg .b32 e, r; .reg .pred ok; "
            f"setp.ge.f32 ok, $1, {_hex(EX2_FLOOR)}; "
            f"add.f32 t, $1, {_hex(EX2_ROUND)}; sub.f32 n, t, {_hex(EX2_ROUND)}; sub.f32 f, $1, n; "
            f"fma.rn.f32 p, f, {c[5]}, {c[4]}; fma.rn.f32 p, p, f, {c[3]}; fma.rn.f32 p, p, f, {c[2]}; "
            f"fma.rn.f32 p, p, f, {c[1]}; fma.rn.f32 p, p, f, {c[0]}; "
            "mov.b32 e, t; shl.b32 e, e, 23; mov.b32 r, p; add.s32 r, r, e; "
            "mov.b32 p, r; selp.f32 $0, p, 0f00000000, ok; }")


def intrinsics():
    """dict name -> numba intrinsic (built on first use: needs numba-cuda)."""
    if _CACHE:
        return _CACHE[0]
    import llvmlite.ir as ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    F32 = ir.FloatType()
    f32 = types.float32

    def asm(text, nargs):
        def cg(ctx, bld, sig, args):
            fn = ir.FunctionType(F32, [F32] * nargs)
            cons = ",".join(["=f"] + ["f"] * nargs)
            return bld.call(ir.InlineAsm(fn, text, cons, side_effect=False), args)
        return cg

    @intrinsic
    def atleast(tc, x, lo):
        return f32(f32, f32), asm("max.f32 $0, $1, $2;", 2)

    @intrinsic
    def ex2_fma(tc, x):
        return f32(f32), asm(_ex2_fma_asm(), 1)

    ops = dict(atleast=atleast, ex2_fma=ex2_fma)
    assert set(ops) == set(NAMES)
    _CACHE.append(ops)
    return ops
