"""A vectorisable exp2 for float32 kernels.

pip's llvmlite ships without SVML, so ``math.exp`` inside a loop stays a scalar libm call
and caps the softmax at a few hundred MFLOP/s.  This polynomial (Cephes ``exp2f``
coefficients, |rel err| < 2e-7 on the float32 range) is plain arithmetic plus one integer
bit-cast, which LLVM vectorises.  The kernels work in base 2: scores are pre-multiplied by
log2(e), so ``exp(s - m) == exp2(s2 - m2)``.

Inputs below -126 flush to 0 (the kernels' finite "minus infinity" ``blocks.NEG`` included),
which is what the online softmax wants; inputs above 127 saturate.  float64 kernels use ``math.exp2``: they are
the accuracy path, not the speed path.
"""
import platform

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir


@intrinsic
def _bits_to_f32(typingctx, x):
    """Reinterpret an int32 as float32 (no numba builtin does this for scalars)."""
    if not isinstance(x, types.Integer) or x.bitwidth != 32:
        return None
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


# Full fast-math (measured ~8% faster than without 'nnan'/'ninf'); the kernels therefore never
# form infinities (see blocks.NEG).
FASTMATH = True


@njit(inline="always", fastmath=FASTMATH, cache=True)
def exp2f(x):
    x = min(max(x, np.float32(-127.0)), np.float32(127.0))
    n = np.floor(x + np.float32(0.5))
    f = x - n  # in [-0.5, 0.5]
    p = np.float32(1.535336188319500e-4)
    p = p * f + np.float32(1.339887440266574e-3)
    p = p * f + np.float32(9.618437357674640e-3)
    p = p * f + np.float32(5.550332471162809e-2)
    p = p * f + np.float32(2.402264791363012e-1)
    p = p * f + np.float32(6.931472028550421e-1)
    p = p * f + np.float32(1.0)
    # 2**n through the exponent field; n == -127 gives bits 0, i.e. exactly 0.0
    scale = _bits_to_f32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))
    return p * scale


@intrinsic
def fmax(typingctx, a, b):
    """max(a, b) as ``llvm.maxnum``: numba's ``max`` lowers to fcmp + select without
    fast-math flags on the select, which LLVM will not vectorise as a reduction (a row max
    ran ~9x slower, scalar ``vmaxss``); ``maxnum`` reductions vectorise."""
    if a != b or a not in (types.float32, types.float64):
        return None
    sig = a(a, b)

    def codegen(context, builder, signature, args):
        lt = context.get_value_type(signature.args[0])
        name = "llvm.maxnum.f32" if signature.args[0] == types.float32 else "llvm.maxnum.f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lt, [lt, lt]), name)
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def wide_vectors(typingctx):
    """Ask LLVM to vectorise the enclosing function with 512-bit vectors where the CPU has
    them.  LLVM prefers 256-bit vectors on AVX-512 CPUs by default; for the exp/max loops of
    the kernels 512 bits measured faster.  Harmless on CPUs without AVX-512 (the vectoriser is
    still bounded by the real register width).  Implemented as LLVM string attributes on the
    function being lowered (llvmlite has no public API for string attributes)."""
    sig = types.none()

    def codegen(context, builder, signature, args):
        attrs = builder.function.attributes
        set.add(attrs, '"prefer-vector-width"="512"')
        set.add(attrs, '"min-legal-vector-width"="512"')
        return context.get_dummy_value()

    return sig, codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_MXCSR_FTZ_DAZ = 0x8040  # flush-to-zero (bit 15) and denormals-are-zero (bit 6)


@intrinsic
def denormals_off(typingctx):
    """Set FTZ/DAZ in this thread's MXCSR and return the previous MXCSR (x86; elsewhere a
    no-op returning 0).  Softmax weights far below the row max and accumulators rescaled by
    tiny factors become subnormal; one subnormal operand in a tile makes the gemm and the
    vector loops take microcode assists (a 'local' workload ran 2.6x slower than a random
    one).  Values below 2**-126 are irrelevant next to a row max of weight 1.  The kernels
    restore the register with ``restore_mxcsr`` at the end of every work item, so other code
    on numba's worker threads is unaffected."""
    sig = types.int32()

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        if not _X86:
            return ir.Constant(i32, 0)
        slot = cgutils.alloca_once(builder, i32)
        ptr = builder.bitcast(slot, ir.IntType(8).as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()])
        st = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.stmxcsr")
        ld = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.ldmxcsr")
        builder.call(st, [ptr])
        old = builder.load(slot)
        builder.store(builder.or_(old, ir.Constant(i32, _MXCSR_FTZ_DAZ)), slot)
        builder.call(ld, [ptr])
        return old

    return sig, codegen


@intrinsic
def restore_mxcsr(typingctx, old):
    """Put back the MXCSR value returned by ``denormals_off``."""
    if old != types.int32:
        return None
    sig = types.none(old)

    def codegen(context, builder, signature, args):
        if _X86:
            slot = cgutils.alloca_once_value(builder, args[0])
            ptr = builder.bitcast(slot, ir.IntType(8).as_pointer())
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()])
            ld = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.ldmxcsr")
            builder.call(ld, [ptr])
        return context.get_dummy_value()

    return sig, codegen
