"""cpu/prefetch.py: the gather hint compiles to llvm.prefetch, reads nothing itself and changes
no result (rows of any width, the first ROW_BYTES bytes only)."""
import numpy as np
from numba import njit

from tiga_numba.cpu.prefetch import ROW_BYTES, prefetch_row


@njit
def _gather_sum(a, idx, ahead):
    s = 0.0
    for t in range(idx.shape[0]):
        if t + ahead < idx.shape[0]:
            prefetch_row(a, idx[t + ahead])
        s += a[idx[t]].sum()
    return s


def test_prefetch_compiles_to_the_hint_and_changes_nothing():
    r = np.random.default_rng(3)
    for shape in ((50, 3), (40, 4, 8), (30, 2, ROW_BYTES)):  # a row narrower / wider than ROW_BYTES
        a = r.standard_normal(shape).astype(np.float32)
        idx = r.integers(0, shape[0], 400)
        want = sum(float(a[i].sum(dtype=np.float64)) for i in idx)
        assert abs(_gather_sum(a, idx, 8) - want) <= 1e-3 * max(1.0, abs(want))
        assert _gather_sum(a, idx, 8) == _gather_sum(a, idx, 10 ** 6)  # hint off: same bits
    ir = "".join(_gather_sum.inspect_llvm().values())
    assert "llvm.prefetch" in ir
