"""ScratchPool: buffers lent by size, reused after return, never lent twice at once; OutputPool:
buffers of results lent again only once nothing refers to them."""
import threading

import numpy as np

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


def _addr(a):
    return a.__array_interface__["data"][0]


def test_output_pool_lends_a_buffer_again_only_when_nothing_refers_to_it():
    from tiga_numba.scratch import OutputPool
    pool = OutputPool(1 << 20)
    a = pool.empty((10, 10), np.float32)
    first = _addr(a)
    view = a[2:5]
    del a
    b = pool.empty((100,), np.float32)   # same size; the view still reads the first buffer
    assert _addr(b) != first
    b_addr = _addr(b)
    mem = memoryview(view)               # an exported buffer holds it too
    del view
    assert _addr(pool.empty((400,), np.uint8)) not in (first, b_addr)
    del mem
    c = pool.empty((5, 20), np.float32)  # free now: lent again
    assert _addr(c) == first and c.shape == (5, 20) and c.flags.c_contiguous
    assert pool.held_bytes == 3 * 400


def test_output_pool_limit_and_clear():
    from tiga_numba.scratch import OutputPool
    pool = OutputPool(1000)
    big = pool.empty((2000,), np.uint8)      # above the limit: a plain array, not kept
    assert pool.held_bytes == 0 and big.nbytes == 2000
    a = pool.empty((600,), np.uint8)
    b = pool.empty((600,), np.uint8)          # would pass the limit while a is lent: not kept
    assert pool.held_bytes == 600
    del a, b
    c = pool.empty((800,), np.uint8)          # the free 600-byte buffer makes room
    assert pool.held_bytes == 800
    c[:] = 7
    pool.clear()
    assert pool.held_bytes == 0
    assert pool.empty((800,), np.uint8).__array_interface__["data"][0] != c.__array_interface__["data"][0]
    assert (c == 7).all()   # a lent array stays valid and is not lent again after clear()


def test_outputs_from_is_per_thread_and_nests():
    import threading
    from tiga_numba import scratch
    pool = scratch.OutputPool(1 << 20)
    seen = []
    with scratch.outputs_from(pool):
        a = scratch.output_empty((8,), np.float64)
        z = scratch.output_zeros((8,), np.float64)
        t = threading.Thread(target=lambda: seen.append(scratch.output_empty((8,), np.float64)))
        t.start()
        t.join()
        with scratch.outputs_from(None):
            plain = scratch.output_empty((8,), np.float64)
    assert pool.held_bytes == 2 * 64 and not z.any()
    assert a.base is not None and plain.base is None and seen[0].base is None
