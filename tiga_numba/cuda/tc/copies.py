"""Inline-PTX copies smaller than ptx.py's 16-byte cp.async (sm_80+): predicated 8- and 4-byte
`cp.async.ca` from global to shared memory, for per-row values whose rows are not contiguous (the
backward's per-query statistics of one head: one (m2, log2 l) pair or one Delta per row, rows
H heads apart).

Kept apart from ptx.py for the reason barriers.py is: a kernel text that calls these imports this
module in its own prelude line (`prelude_line`), which carries this file's digest, so editing it
re-keys the cubins of exactly those kernels. Each intrinsic's meaning is mirrored in emulator.py
(`Warps.cp_async8_if` / `cp_async4_if`); keep the two in step.

`cp_async{8,4}_if(pred, saddr, gaddr, nbytes)`: where pred != 0, copy `nbytes` (the copy size or
0) from global `gaddr` to shared `saddr` and zero-fill the rest of the copy size; where pred == 0
the thread issues nothing. Like every cp.async the bytes land by the thread's next
cp.async.wait_group covering the commit group it was issued in.
"""
from __future__ import annotations

import hashlib
import inspect

_CACHE = []

#: the names this module provides to a kernel text (and emulator.py mirrors)
NAMES = ("cp_async8_if", "cp_async4_if")


def digest():
    """sha1 prefix of this module's source: part of every prelude_line, hence of the cubin key."""
    import sys
    return hashlib.sha1(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:16]


def prelude_line():
    """the module-level line a kernel text that uses these intrinsics starts with."""
    return (f"from tiga_numba.cuda.tc.copies import intrinsics as _copies; "
            f"globals().update(_copies())  # copies {digest()}")


def intrinsics():
    """dict name -> numba intrinsic (built on first use: needs numba-cuda)."""
    if _CACHE:
        return _CACHE[0]
    import llvmlite.ir as ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    I32, I64 = ir.IntType(32), ir.IntType(64)
    u32, i64 = types.uint32, types.int64

    def copy_op(name, size):
        text = ("{.reg .pred p; setp.ne.u32 p, $0, 0; "
                f"@p cp.async.ca.shared.global [$1], [$2], {size}, $3;}}")

        def typer(tc, pred, saddr, gaddr, nbytes):
            def cg(ctx, bld, sig, args):
                fn = ir.FunctionType(ir.VoidType(), [I32, I32, I64, I32])
                bld.call(ir.InlineAsm(fn, text, "r,r,l,r,~{memory}", side_effect=True), args)
                return ctx.get_dummy_value()
            return types.void(u32, u32, i64, u32), cg
        scope = {"typer": typer}
        exec(f"def {name}(tc, pred, saddr, gaddr, nbytes):\n    return typer(tc, pred, saddr, gaddr, nbytes)\n", scope)
        return intrinsic(scope[name])

    ops = dict(cp_async8_if=copy_op("cp_async8_if", 8), cp_async4_if=copy_op("cp_async4_if", 4))
    assert set(ops) == set(NAMES)
    _CACHE.append(ops)
    return ops
