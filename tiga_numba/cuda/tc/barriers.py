"""Inline-PTX synchronisation intrinsics that let warpgroups of one CTA run out of step (sm_90):
mbarriers (the shared-memory barriers with phases that track cp.async copies and releases of a
buffer slot) and named barriers (bar.sync / bar.arrive with an id and a thread count, the
ping-pong between two warpgroups).

Kept apart from ptx.py on purpose: a kernel text that calls these imports this module in its own
prelude (`prelude_line`), and that line carries a digest of this file, so editing it re-keys the
cubins of exactly those kernels and no other (ptx.py's digest keys every tensor-core cubin).
Each intrinsic's meaning is mirrored in emulator.py (`Warps.mbar_*`); keep the two in step.

mbarrier semantics used here (PTX ISA, "mbarrier"): a barrier is initialised with an expected
arrival count; its current phase completes when that many arrivals happened, and the next phase
starts. `mbarrier.try_wait.parity` with parity p returns once the phase of parity p has completed,
i.e. while the current phase's parity differs from p (so on a fresh barrier, parity 1 passes at
once and parity 0 waits for the first phase). `cp.async.mbarrier.arrive.noinc` makes the arrival
of the executing thread happen when all of its earlier cp.async copies have landed: a consumer
that waited on the phase sees every producer's bytes without the producers waiting for them.
"""
from __future__ import annotations

import hashlib
import inspect

_CACHE = []

#: the names this module provides to a kernel text (and emulator.py mirrors)
NAMES = ("mbar_init_if", "mbar_init_fence", "mbar_arrive", "mbar_cp_arrive", "mbar_wait",
         "bar_sync_n", "bar_arrive_n", "bar_sync_if", "bar_arrive_if")


def digest():
    """sha1 prefix of this module's source: part of every prelude_line, hence of the cubin key."""
    import sys
    return hashlib.sha1(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()[:16]


def prelude_line():
    """the module-level line a kernel text that uses these intrinsics starts with."""
    return (f"from tiga_numba.cuda.tc.barriers import intrinsics as _barriers; "
            f"globals().update(_barriers())  # barriers {digest()}")


def intrinsics():
    """dict name -> numba intrinsic (built on first use: needs numba-cuda)."""
    if _CACHE:
        return _CACHE[0]
    import llvmlite.ir as ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    I32 = ir.IntType(32)
    u32 = types.uint32

    def asm(bld, argtys, text, cons, args):
        fn = ir.FunctionType(ir.VoidType(), argtys)
        return bld.call(ir.InlineAsm(fn, text, cons, side_effect=True), args)

    def void_op(name, nargs, text):
        """an intrinsic of `nargs` u32 operands ($0 ...) that emits `text` and orders memory."""
        cons = ",".join(["r"] * nargs + ["~{memory}"])

        def typer(tc, *args):
            def cg(ctx, bld, sig, args):
                asm(bld, [I32] * nargs, text, cons, args)
                return ctx.get_dummy_value()
            return types.void(*([u32] * nargs)), cg
        names = ", ".join(f"x{i}" for i in range(nargs))
        scope = {"typer": typer}
        exec(f"def {name}(tc{', ' if nargs else ''}{names}):\n    return typer(tc{', ' if nargs else ''}{names})\n", scope)
        return intrinsic(scope[name])

    # the wait loops on try_wait (which itself suspends for a system-dependent time); the labels
    # live inside the asm block's braces, so every inlined copy has its own
    wait_text = ("{.reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; "
                 "@!p bra WAIT;}")
    ops = dict(
        # one thread initialises (pred != 0 in that thread only)
        mbar_init_if=void_op("mbar_init_if", 3, "{.reg .pred p; setp.ne.u32 p, $0, 0; @p mbarrier.init.shared::cta.b64 [$1], $2;}"),
        mbar_init_fence=void_op("mbar_init_fence", 0, "fence.mbarrier_init.release.cluster;"),
        mbar_arrive=void_op("mbar_arrive", 1, "{.reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0];}"),
        mbar_cp_arrive=void_op("mbar_cp_arrive", 1, "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];"),
        mbar_wait=void_op("mbar_wait", 2, wait_text),
        bar_sync_n=void_op("bar_sync_n", 2, "bar.sync $0, $1;"),
        bar_arrive_n=void_op("bar_arrive_n", 2, "bar.arrive $0, $1;"),
        # warpgroup-uniform predicates only (bar.* are .aligned: a warp takes them together)
        bar_sync_if=void_op("bar_sync_if", 3, "{.reg .pred p; setp.ne.u32 p, $0, 0; @p bar.sync $1, $2;}"),
        bar_arrive_if=void_op("bar_arrive_if", 3, "{.reg .pred p; setp.ne.u32 p, $0, 0; @p bar.arrive $1, $2;}"),
    )
    assert set(ops) == set(NAMES)
    _CACHE.append(ops)
    return ops
