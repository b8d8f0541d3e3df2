"""CI without a GPU: every CUDA-core kernel specialisation compiles to PTX for sm_90.

Specialisations are (kernel family x input dtype x head dims x pruning / edge bias); head dims
cover the tile-size regimes (small, 64, 128, 256, D = 0 for precomputed scores, odd sizes).
The register-resident design is checked too: no kernel may touch local memory (a local
array spilled there would make the kernel several times slower).
Skipped when numba-cuda is not installed.
"""
import importlib.util
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                reason="numba-cuda is not installed")


def _shield():
    """numba-cuda's import redirector matches any module name containing "numba.cuda"."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "NumbaCudaFinder" and not getattr(finder, "_tiga_shielded", False):
            original = finder.find_spec

            def find_spec(name, path=None, target=None, _original=original):
                if name == "tiga_numba.cuda" or name.startswith("tiga_numba.cuda."):
                    return None
                return _original(name, path, target)
            finder.find_spec = find_spec
            finder._tiga_shielded = True


def _factories(dtype, D, DV):
    _shield()
    from tiga_numba.cuda import blocks, csr, tiles
    from tiga_numba.cuda.common import make_delta, make_stats
    out = []
    tf = tiles.block_tiles("fwd", dtype, D, DV)
    out.append(("blocks.fwd", lambda: blocks.make_forward(tf, False)))
    out.append(("blocks.fwd+prune", lambda: blocks.make_forward(tf, True)))
    tq = tiles.block_tiles("dq", dtype, D, DV)
    out.append(("blocks.dq", lambda: blocks.make_dq(tq)))
    tk = tiles.block_tiles("dkdv", dtype, D, DV)
    out.append(("blocks.dkdv", lambda: blocks.make_dkdv(tk)))
    cf = tiles.csr_tiles("fwd", dtype, D, DV)
    cb = tiles.csr_tiles("bwd", dtype, D, DV)
    for bias in (False, True):
        tag = "+bias" if bias else ""
        out.append(("csr.fwd" + tag, lambda b=bias: csr.make_forward(cf, b)))
        out.append(("csr.dq" + tag, lambda b=bias: csr.make_dq(cb, b)))
        out.append(("csr.dkdv" + tag, lambda b=bias: csr.make_dkdv(cb, b)))
    out.append(("delta", lambda: make_delta(dtype, tiles.acc_of(dtype))))
    out.append(("stats", lambda: make_stats(dtype, tiles.acc_of(dtype))))
    return out


# (dtype, D, DV): every family for each dtype at D = 64, then the head-dim regimes in float32
# and float16 (the two dtypes the benchmarks use), kept small so CI stays within a minute or two.
CONFIGS = [("float32", 64, 64), ("float16", 64, 64), ("float64", 64, 64),
           ("float32", 128, 128), ("float16", 128, 128), ("float32", 256, 256),
           ("float32", 0, 32), ("float32", 24, 40)]


def _ids():
    return [f"{d}-D{a}-Dv{b}" for d, a, b in CONFIGS]


@pytest.mark.parametrize("dtype,D,DV", CONFIGS, ids=_ids())
def test_compile_ptx_sm90(dtype, D, DV):
    for name, make in _factories(dtype, D, DV):
        kern = make()
        ptx = kern.compile_ptx(cc=(9, 0))
        assert ".target sm_90" in ptx, name
        assert ".entry" in ptx or ".visible .entry" in ptx, name
        assert "ld.local" not in ptx and "st.local" not in ptx, f"{name}: local memory used"
        if name.startswith(("blocks", "csr")) and D > 0:
            assert "shfl.sync" in ptx or kern.name.endswith("g1"), f"{name}: no lane-group reduction"


def test_tile_geometry_fits_static_shared_memory():
    _shield()
    from tiga_numba.cuda import tiles
    for dtype in ("float16", "float32", "float64"):
        for D in (0, 1, 16, 24, 32, 64, 96, 128, 200, 256):
            for DV in (1, 32, 64, 128, 256):
                for kind in ("fwd", "dq", "dkdv"):
                    t = tiles.block_tiles(kind, dtype, D, DV)
                    asz = 8 if t.acc == "float64" else 4
                    smem = t.BN * (t.DP + t.DVP) * asz
                    smem += t.BM * (t.BN + 4) * asz if kind == "fwd" else 3 * t.BN * asz
                    assert smem <= 48 * 1024, (kind, dtype, D, DV, t)
                    assert 32 <= t.NT <= 256 and t.NT % 32 == 0 and 32 % t.G == 0
                    regs = t.R * (t.DSQ + t.DSV) * (2 if kind != "fwd" else 1)
                    assert regs * (2 if t.acc == "float64" else 1) <= 256, (kind, dtype, D, DV, t)
