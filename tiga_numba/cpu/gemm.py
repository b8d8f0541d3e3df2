"""Row-major ``C = op(A) @ op(B) + beta * C`` on 2-D strided views, through numba's BLAS hook.

``np.dot`` in numba only takes contiguous operands, always overwrites its output and, when
its second operand is a transposed view, lands in OpenBLAS's slow ``A @ B.T`` path (measured
~95 vs ~150 GFLOP/s for 64..128-sized float32 tiles on the 2-core machine).  The kernels
instead call ``numba_xxgemm`` - the symbol numba's own ``np.dot`` calls, which forwards to
scipy's ``cython_blas`` - directly, with explicit leading dimensions (tiles are views into
head-major arrays, no copies) and ``beta = 1`` to accumulate in place.  Operands must have
unit stride along their last axis (true for every view the kernels make).
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_ll_char = ir.IntType(8)
_ll_voidp = ir.IntType(8).as_pointer()


@intrinsic
def _xxgemm(typingctx, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    if not all(isinstance(x, types.Array) for x in (a, b, c)):
        return None
    dtype = c.dtype
    if dtype not in (types.float32, types.float64):
        return None
    kind = ord("s" if dtype == types.float32 else "d")
    sig = types.int32(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def codegen(context, builder, signature, args):
        (ta, tb, m_, n_, k_, al, a_, lda_, b_, ldb_, be, c_, ldc_) = args
        st = signature.args
        intp = context.get_value_type(types.intp)

        def data(ty, val):
            return builder.bitcast(context.make_array(ty)(context, builder, val).data, _ll_voidp)

        def slot(ty, val):
            v = context.cast(builder, val, ty, dtype)
            return builder.bitcast(cgutils.alloca_once_value(builder, v), _ll_voidp)

        def char(ty, flag):
            f = context.cast(builder, flag, ty, types.boolean)
            return builder.select(f, ir.Constant(_ll_char, ord("t")), ir.Constant(_ll_char, ord("n")))

        def isz(ty, val):
            return context.cast(builder, val, ty, types.intp)

        fnty = ir.FunctionType(ir.IntType(32), [
            _ll_char, _ll_char, _ll_char, intp, intp, intp, _ll_voidp, _ll_voidp, intp,
            _ll_voidp, intp, _ll_voidp, _ll_voidp, intp])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        return builder.call(fn, (
            ir.Constant(_ll_char, kind), char(st[0], ta), char(st[1], tb),
            isz(st[2], m_), isz(st[3], n_), isz(st[4], k_), slot(st[5], al),
            data(st[6], a_), isz(st[7], lda_), data(st[8], b_), isz(st[9], ldb_),
            slot(st[10], be), data(st[11], c_), isz(st[12], ldc_)))

    return sig, codegen


@njit(inline="always", cache=True)
def mm(a, b, c, beta, trans_a, trans_b):
    """c = op(a) @ op(b) + beta * c for 2-D views with unit last-axis stride (row-major);
    op(x) = x.T when trans_x.  Shapes are not checked here: callers pass matching tiles."""
    isz = c.itemsize
    M = c.shape[0]
    N = c.shape[1]
    K = a.shape[0] if trans_a else a.shape[1]
    # column-major BLAS sees every row-major view transposed: C^T = op(B)^T op(A)^T
    _xxgemm(trans_b, trans_a, N, M, K, 1.0, b, b.strides[0] // isz, a, a.strides[0] // isz,
            beta, c, c.strides[0] // isz)
