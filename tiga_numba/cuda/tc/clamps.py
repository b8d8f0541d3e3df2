"""Inline-PTX clamp of a modified score with one bound (sm_80+), for the score-modifier text
(generator/modifier.py) where the value has a static bound above and only its floor is needed.

Kept apart from ptx.py for the reason barriers.py and copies.py are: a kernel text that calls it
imports this module in its own prelude line (`prelude_line`), which carries this file's digest,
so editing it re-keys the cubins of exactly those kernels. Mirrored in emulator.py (`_atleast`);
keep the two in step.

`atleast(x, lo)`: max.f32(x, lo): x where x >= lo, lo where x < lo or x is NaN (PTX's max returns
the other operand of a NaN). One instruction; ptx.clampf is this followed by min.f32.
"""
from __future__ import annotations

import hashlib
import inspect

_CACHE = []

#: the names this module provides to a kernel text (and emulator.py mirrors)
NAMES = ("atleast",)


def digest():
    """sha1 prefix of this module's source: part of every prelude_line, hence of the cubin key."""
    import sys
    return hashlib.sha1(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:16]


def prelude_line():
    """the module-level line a kernel text that uses this intrinsic starts with."""
    return (f"from tiga_numba.cuda.tc.clamps import intrinsics as _clamps; "
            f"globals().update(_clamps())  # clamps {digest()}")


def intrinsics():
    """dict name -> numba intrinsic (built on first use: needs numba-cuda)."""
    if _CACHE:
        return _CACHE[0]
    import llvmlite.ir as ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    F32 = ir.FloatType()
    f32 = types.float32

    @intrinsic
    def atleast(tc, x, lo):
        sig = f32(f32, f32)

        def cg(ctx, bld, sig, args):
            fn = ir.FunctionType(F32, [F32, F32])
            return bld.call(ir.InlineAsm(fn, "max.f32 $0, $1, $2;", "=f,f,f", side_effect=False), args)
        return sig, cg

    ops = dict(atleast=atleast)
    assert set(ops) == set(NAMES)
    _CACHE.append(ops)
    return ops
