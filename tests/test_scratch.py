"""ScratchPool: buffers lent by size, reused after return, never lent twice at once; arrays lent
until their last view is gone; scratch.lending for the CPU kernels' large allocations."""
import gc
import threading

import numpy as np

from tiga_numba import scratch
from tiga_numba.scratch import ScratchPool


def _address(a):
    return a.__array_interface__["data"][0]


def test_a_returned_buffer_is_lent_again_for_the_same_size():
    pool = ScratchPool(1 << 20)
    with pool.borrow((10, 4, 8), np.float32) as a:
        assert a.shape == (10, 4, 8) and a.dtype == np.float32 and a.flags.c_contiguous
        a[...] = 1.5
        first = _address(a)
    assert pool.idle_bytes == a.nbytes
    # the same bytes in another shape and dtype: the same memory, still holding what was written
    with pool.borrow((5, 4, 8), np.float64) as b:
        assert _address(b) == first and b.dtype == np.float64
        assert np.all(b.view(np.float32) == 1.5)
        assert pool.idle_bytes == 0
    with pool.borrow((11, 4, 8), np.float32) as c:   # another size: another buffer
        assert _address(c) != first


def test_buffers_in_use_are_distinct_across_threads():
    pool = ScratchPool(1 << 24)
    with pool.borrow((256,), np.float64):
        pass   # one idle buffer of this size
    barrier, seen, errors = threading.Barrier(4), [], []

    def task(i):
        with pool.borrow((256,), np.float64) as a:
            a[...] = i
            barrier.wait()   # all four hold a buffer at once
            seen.append(_address(a))
            if not np.all(a == i):
                errors.append(i)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 4 and not errors
    assert pool.idle_bytes == 4 * 256 * 8


def test_idle_bytes_stay_under_the_limit_oldest_dropped_first():
    pool = ScratchPool(3000)
    with pool.borrow((1000,), np.uint8):
        pass
    with pool.borrow((1500,), np.uint8) as b:
        addr_b = _address(b)
    assert pool.idle_bytes == 2500
    with pool.borrow((1200,), np.uint8):
        pass   # 3700 idle: the 1000-byte buffer, returned first, is dropped
    assert pool.idle_bytes == 2700 and sorted(pool._idle) == [1200, 1500]
    with pool.borrow((1500,), np.uint8) as b2:
        assert _address(b2) == addr_b
    with pool.borrow((4000,), np.uint8):
        pass   # larger than the limit: not kept
    assert pool.idle_bytes <= 3000 and 4000 not in pool._idle
    pool.clear()
    assert pool.idle_bytes == 0


def test_a_failing_borrower_still_returns_the_buffer():
    pool = ScratchPool(1 << 20)
    try:
        with pool.borrow((64,), np.float32):
            raise RuntimeError("kernel failed")
    except RuntimeError:
        pass
    assert pool.idle_bytes == 256


def test_a_lent_array_comes_back_when_its_last_view_is_gone():
    pool = ScratchPool(1 << 30)
    a = pool.lend((256, 512), np.float32)
    addr = a.__array_interface__["data"][0]
    view = a[3:7, ::2]
    del a
    gc.collect()
    assert pool.idle_bytes == 0            # a view still holds it
    view[...] = 1.0                        # and it is still valid memory
    del view
    gc.collect()
    assert pool.idle_bytes == 256 * 512 * 4
    b = pool.lend((512, 256), np.float32)  # same size, another shape: the same buffer
    assert b.__array_interface__["data"][0] == addr and pool.idle_bytes == 0
    assert b.flags.c_contiguous and b.flags.writeable and b.shape == (512, 256)


def test_lending_routes_only_large_arrays_and_only_inside_the_block():
    pool = ScratchPool(1 << 30)
    big = scratch.LEND_MIN_BYTES // 4
    with scratch.lending(pool):
        lent = scratch.zeros((big,), np.float32)
        small = scratch.empty((10,), np.float32)
        filled = scratch.full((big,), -np.inf, np.float32)
    outside = scratch.empty((big,), np.float32)
    assert (lent == 0).all() and np.isneginf(filled).all()
    assert small.base is None and outside.base is None      # plain numpy allocations
    del lent, filled
    gc.collect()
    assert pool.idle_bytes == 2 * big * 4
    seen = []

    def other_thread():   # the block's setting is per thread: another thread allocates normally
        seen.append(scratch.empty((big,), np.float32).base is None)
    with scratch.lending(pool):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen == [True]


def test_kernel_outputs_lent_from_a_pool_are_the_same_results():
    """The CPU kernels allocate their large outputs and copies through scratch.empty: inside
    lending() they come from the pool (and go back to it), with the same bits."""
    import tiga_numba as tg
    rng = np.random.default_rng(0)
    n = 2048
    q, k, v, do = (rng.standard_normal((n, 4, 512)).astype(np.float32) for _ in range(4))   # 16 MiB each
    src, dst = rng.integers(0, n, 4 * n), rng.integers(0, n, 4 * n)
    pool = ScratchPool(1 << 32)
    for g in (tg.Graph.from_coo(src, dst, n, n), tg.Graph.cu_seqlens([0, 100, n])):
        want_out, want_st = tg.attention(q, k, v, g, return_stats=True)
        want = tg.attention_backward(do, q, k, v, want_out, want_st, g)
        with scratch.lending(pool):
            out, st = tg.attention(q, k, v, g, return_stats=True)
            got = tg.attention_backward(do, q, k, v, out, st, g)
        assert out.base is not None   # lent
        np.testing.assert_array_equal(out, want_out)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        del out, st, got
        gc.collect()
        assert pool.idle_bytes > 0
