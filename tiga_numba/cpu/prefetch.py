"""Software prefetch of gathered rows for the CSR kernels.

A CSR row kernel reads the k / v rows of its edges' sources at random. Once k and v outgrow
the L2 cache every such row is a few cache misses whose latency the loop waits for: the kernel
ran at about a third of the speed of the same arithmetic on rows already in cache. The kernels
therefore ask for the rows of the next chunk of edges while they compute the current one
(``prefetch_row``), so their misses overlap with arithmetic instead of following it.
``llvm.prefetch`` is a hint: on a CPU or address where it does nothing the result is the same.
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

LINE = 64  # bytes per cache line on every x86-64 and most ARM64 cores
# At most this many bytes from the start of a row: the hardware prefetcher follows a long row's
# sequential rest on its own, and the kernels' look-ahead (16 rows of k and v) then stays within
# 32 KB, well inside L2 on any machine, instead of evicting the rows it is about to use.
ROW_BYTES = 1024


@intrinsic
def _prefetch_line(typingctx, array, row, offset):
    """Prefetch the cache line at byte `offset` of row `row` of `array` (any ndim >= 1)."""
    if not isinstance(array, types.Array) or not isinstance(row, types.Integer) \
            or not isinstance(offset, types.Integer):
        return None
    sig = types.void(array, row, offset)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        stride0 = cgutils.unpack_tuple(builder, ary.strides, aryty.ndim)[0]
        r = context.cast(builder, args[1], signature.args[1], types.int64)
        off = context.cast(builder, args[2], signature.args[2], types.int64)
        base = builder.ptrtoint(ary.data, i64)
        addr = builder.add(base, builder.add(builder.mul(r, stride0), off))
        ptr_t = ir.IntType(8).as_pointer()
        ptr = builder.inttoptr(addr, ptr_t)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr_t, i32, i32, i32]), "llvm.prefetch.p0")
        # read access, high temporal locality (keep in all levels), data cache
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always", cache=True)
def prefetch_row(array, row):
    """Hint the CPU to bring row `row` of the C-contiguous `array` (axis 0), up to its first
    ROW_BYTES bytes, into cache."""
    nbytes = min(array.strides[0], ROW_BYTES)
    for off in range(0, nbytes, LINE):
        _prefetch_line(array, row, off)
