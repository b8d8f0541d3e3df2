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
    out.append(("csr.fwd+items", lambda: csr.make_forward(cf, False, True)))
    out.append(("csr.dq+items", lambda: csr.make_dq(cb, False, True)))
    out.append(("csr.dkdv+items", lambda: csr.make_dkdv(cb, False, True)))
    out.append(("csr.softmax_merge", lambda: csr.make_softmax_merge(dtype, tiles.acc_of(dtype), DV)))
    out.append(("csr.sum_merge", lambda: csr.make_sum_merge(dtype, tiles.acc_of(dtype), D)))
    from tiga_numba.cuda import decode
    td = decode.decode_tiles(dtype, D, DV, 4)
    out.append(("decode", lambda: decode.make_decode(td)))
    if decode.vector_loads_fit(dtype, D, DV):
        tv = decode.decode_tiles(dtype, D, DV, 4, vec=True)
        out.append(("decode.vec", lambda: decode.make_decode(tv)))
    if decode.mma_fits(dtype, D, DV):
        tm = decode.mma_tiles(dtype, D, DV, 16)
        out.append(("decode.mma", lambda: decode.make_decode_mma(tm)))
    out.append(("decode.merge", lambda: decode.make_merge(dtype, tiles.acc_of(dtype), DV)))
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


def _compile_config(dtype, D, DV):
    """Compile every family of one configuration; returns the problems found (empty: all good)."""
    problems = []
    for name, make in _factories(dtype, D, DV):
        kern = make()
        ptx = kern.compile_ptx(cc=(9, 0))
        if ".target sm_90" not in ptx:
            problems.append(f"{name}: no .target sm_90")
        if ".entry" not in ptx:
            problems.append(f"{name}: no .entry")
        if "ld.local" in ptx or "st.local" in ptx:
            problems.append(f"{name}: local memory used")
        if name.startswith(("blocks", "csr")) and "merge" not in name and D > 0 and not (
                "shfl.sync" in ptx or kern.name.endswith("g1")):
            problems.append(f"{name}: no lane-group reduction")
    return problems


# NVVM compiles are single-threaded and take most of this file's time: the configurations are
# compiled in worker processes (one per core), so a 2-core machine compiles two at a time;
# each test then reads its configuration's result. Only the selected configurations compile.
# Under pytest-xdist the workers already run tests in parallel and each one sees every selected
# test in session.items, not only its own: there each test compiles its own configuration in
# its worker (a pool per worker compiled every configuration in every worker that ran one).
@pytest.fixture(scope="module")
def compiled(request):
    import concurrent.futures
    import multiprocessing
    import os
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield lambda config: _compile_config(*config)
        return
    wanted = [tuple(item.callspec.params[n] for n in ("dtype", "D", "DV"))
              for item in request.session.items
              if getattr(item, "originalname", None) == "test_compile_ptx_sm90"]
    workers = max(1, min(len(wanted), os.cpu_count() or 1))
    ex = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {c: ex.submit(_compile_config, *c) for c in wanted}
    yield lambda config: futures[config].result()
    ex.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("dtype,D,DV", CONFIGS, ids=_ids())
def test_compile_ptx_sm90(dtype, D, DV, compiled):
    problems = compiled((dtype, D, DV))
    assert not problems, problems


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


# --------------------------------------------------------------------------- launch plumbing
def test_param_block_packs_every_type_at_its_pointer():
    """launch._Params: each value lands where its kernelParams pointer points, at its natural
    alignment, whatever the mix of types; a value of the wrong type is refused."""
    import ctypes
    import struct

    import numba
    _shield()
    from tiga_numba.cuda import launch
    ctype = {"int64": ctypes.c_int64, "int32": ctypes.c_int32, "float32": ctypes.c_float,
             "float64": ctypes.c_double}
    rng = __import__("numpy").random.default_rng(7)
    kinds = [numba.int64, numba.int32, numba.float32, numba.float64]
    for _ in range(20):
        types = [kinds[i] for i in rng.integers(0, 4, size=int(rng.integers(1, 30)))]
        vals = [float(rng.standard_normal()) if "float" in str(t) else int(rng.integers(-2**31, 2**31))
                for t in types]
        if str(types[0]) == "int64":
            vals[0] = 2 ** 47 + 12345  # a device address
        p = launch._Params(tuple(types))
        p.pack(vals)
        table = (ctypes.c_void_p * len(types)).from_address(p.address)
        for i, (t, want) in enumerate(zip(types, vals)):
            assert table[i] % ctypes.sizeof(ctype[str(t)]) == 0
            got = ctype[str(t)].from_address(table[i]).value
            if str(t) == "float32":
                want = struct.unpack("f", struct.pack("f", want))[0]
            assert got == want, (i, str(t), got, want)
    with pytest.raises(struct.error):
        launch._Params((numba.int64,)).pack([1.5])


def test_param_launch_pads_grid_and_block_and_passes_the_packed_buffer():
    """_Params.launch: 1- and 2-tuples become 3-D, the dynamic shared-memory size and stream go
    through, and the driver sees the values packed at call time (read back via the table)."""
    import ctypes

    import numba
    _shield()
    from tiga_numba.cuda import launch
    p = launch._Params((numba.int64, numba.float32))
    seen = []

    def launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        table = (ctypes.c_void_p * 2).from_address(params)
        seen.append((func, gx, gy, gz, bx, by, bz, smem, stream, extra,
                     ctypes.c_int64.from_address(table[0]).value,
                     ctypes.c_float.from_address(table[1]).value))
    p.launch(launch_kernel, 11, (5, 3), (128,), 65536, 77, (2 ** 40 + 3, 0.5))
    p.launch(launch_kernel, 11, (2,), (32, 2), 0, 0, (9, -1.25))
    assert seen == [(11, 5, 3, 1, 128, 1, 1, 65536, 77, 0, 2 ** 40 + 3, 0.5),
                    (11, 2, 1, 1, 32, 2, 1, 0, 0, 0, 9, -1.25)]


def test_stream_wrappers_stay_bounded(monkeypatch):
    """launch.current_stream wraps each cupy stream once; a program that makes a fresh stream per
    call must not grow the table without end. The tensor-core path shares the same wrappers."""
    import types as _t
    _shield()
    from tiga_numba.cuda import launch
    from tiga_numba.cuda.tc import api as tc_api
    ptrs = iter(range(1000, 1000 + 10 * launch.MAX_STREAMS))
    cur = {}
    monkeypatch.setattr(launch, "_GET_STREAM", [lambda: cur["s"]])
    monkeypatch.setattr(launch, "_STREAMS", {})
    for _ in range(5 * launch.MAX_STREAMS):
        cur["s"] = _t.SimpleNamespace(ptr=next(ptrs))
        a = launch.current_stream()
        assert a.ptr == cur["s"].ptr and launch.current_stream() is a and tc_api.current_stream() is a
        assert len(launch._STREAMS) <= launch.MAX_STREAMS


def test_cubin_records_are_one_file_and_refuse_what_is_not_one(tmp_path):
    """write_cubin/read_cubin: entry name and cubin in one file (one rename: no pairing of one
    process's entry name with another's cubin); a raw cubin of an older layout, a truncated or
    missing file read as a miss; no path (caching off) writes nothing."""
    from tiga_numba import disk_cache
    elf = b"\x7fELF" + bytes(range(256)) * 3          # holds newlines, as real cubins do
    path = str(tmp_path / "c" / "k-sm90.cubin")
    assert disk_cache.read_cubin(path) is None
    disk_cache.write_cubin(path, "_Z1kPf", elf)
    assert disk_cache.read_cubin(path) == ("_Z1kPf", elf)
    assert sorted(x.name for x in (tmp_path / "c").iterdir()) == ["k-sm90.cubin"]
    (tmp_path / "c" / "k-sm90.cubin").write_bytes(elf)   # raw cubin, no entry line
    assert disk_cache.read_cubin(path) is None
    (tmp_path / "c" / "k-sm90.cubin").write_bytes(b"_Z1kPf\n\x7fEL")
    assert disk_cache.read_cubin(path) is None
    disk_cache.write_cubin(None, "_Z1kPf", elf)
    assert disk_cache.read_cubin(None) is None


_RECORDS_SCRIPT = r'''
import sys, types
from types import SimpleNamespace
import numpy as np

# a host stand-in for cupy: arrays are numpy arrays with .data.ptr; kernels are not run,
# their launches are recorded (the arguments the GPU would get)
class FA(np.ndarray):
    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])
    def get(self, stream=None):
        return np.asarray(self)
W = lambda a: np.asarray(a).view(FA)
cp = types.ModuleType("cupy")
cp.ndarray = FA
cp.empty = lambda s, d=np.float32: W(np.empty(s, d))
cp.full = lambda s, x, d=np.float32: W(np.full(s, x, d))
cp.zeros = lambda s, d=np.float32: W(np.zeros(s, d))
cp.ascontiguousarray = lambda a, dtype=None: W(np.ascontiguousarray(a, dtype=dtype))
cp.asarray = lambda a, dtype=None: W(np.asarray(a, dtype=dtype))
cp.broadcast_to = lambda a, shape: W(np.broadcast_to(a, shape))
cp.asnumpy = lambda a: np.asarray(a)
cp.cuda = SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 0),
                          get_current_stream=lambda: SimpleNamespace(ptr=0),
                          Device=lambda *a: SimpleNamespace(attributes={"MultiProcessorCount": 132}))
sys.modules["cupy"] = cp

import tiga_numba as tg
from tiga_numba import arrays, functional
from tiga_numba.cuda import launch
_lib = arrays.library_of
arrays.library_of = lambda name, a: "cupy" if isinstance(a, FA) else _lib(name, a)
from tiga_numba.kernel_cache import KERNELS
from tiga_numba.graph import BlockRelation, CSRRelation, CSRTranspose
CALLS = []
launch.Kernel.__call__ = lambda self, grid, block, stream, *a: CALLS.append((self, grid, block, a))
from tiga_numba.cuda import api, tiles
_real = tg.Graph.realize, tg.Graph.realize_transpose

def on_dev(rec):
    return None if rec is None else type(rec)(**{k: (W(v) if isinstance(v, np.ndarray) else v)
                                                 for k, v in rec.__dict__.items()})
tg.Graph.realize = lambda g, dev="cpu": g._cached(("fake", dev), lambda: on_dev(_real[0](g, "cpu")))
tg.Graph.realize_transpose = lambda g, dev="cpu": g._cached(("fakeT", dev), lambda: on_dev(_real[1](g, "cpu")))

rng = np.random.default_rng(3)
def arr(*shape, dt=np.float32, strided=False):
    if strided:
        return W(rng.standard_normal(shape[:-1] + (2 * shape[-1],)).astype(dt))[..., ::2]
    return W(rng.standard_normal(shape).astype(dt))

def addr(x):
    return x.__array_interface__["data"][0]

def check_call(g, H=2, Hkv=1, D=16, DV=8, dt=np.float32, prune=None, bias=False):
    q = arr(g.num_dst, H, D, dt=dt, strided=True)
    k, v = arr(g.num_src, Hkv, D, dt=dt), arr(g.num_src, Hkv, DV, dt=dt)
    acc = np.float64 if dt == np.float64 else np.float32
    eb = arr(g.num_edges, H, dt=acc) if bias else None
    seen = []
    for rep in range(2):
        CALLS.clear()
        hits = KERNELS.hits
        out, st, plan = functional.run_forward(q, k, v, g, block_prune_threshold=prune, edge_bias=eb)
        (kern, grid, block, a), = CALLS
        assert a[:3] == (addr(q), addr(k), addr(v))
        qs = tuple(s // q.itemsize for s in q.strides)
        rel = g.realize("cuda")
        if g.is_implicit:
            t = tiles.block_tiles("fwd", np.dtype(dt).name, D, DV)
            tpb = -(-rel.max_block_dst // t.BM)
            assert grid == (rel.num_blocks * tpb, H, 1) and block == (t.NT, 1, 1)
            assert a[6:11] == (addr(rel.dst_offsets), addr(rel.src_offsets), addr(rel.causal),
                               addr(rel.lo), addr(rel.hi))
            assert a[12:15] == qs and a[21:24] == (tpb, H, H // Hkv)
        else:
            t = tiles.csr_tiles("fwd", np.dtype(dt).name, D, DV)
            assert grid == (-(-g.num_dst * H * t.G // t.NT), 1, 1)
            assert a[6:8] == (addr(rel.indptr), addr(rel.indices))
            assert a[8] == (addr(eb) if bias else 0) and a[9:12] == qs
        assert plan.run_info["kernel"] and plan.run_info["copies"] == []
        # a pruned call's tile counters (a[11]) are a fresh buffer per call: the first call's stays
        # alive until its run_info is read (deferred), so its address may differ
        rest = a[6:11] + a[12:] if prune is not None else a[6:]
        if rep == 1:  # memoised launch record: same launch, counted as kernel-cache hits
            assert plan.run_info["cache"] == "hit" and KERNELS.hits == hits + 1
            assert (grid, block, a[:3], rest) == seen[0], "second call launched differently"
        seen.append((grid, block, a[:3], rest))
    if prune is not None:
        return
    do = arr(g.num_dst, H, DV, dt=dt)
    CALLS.clear()
    functional.run_backward(do, q, k, v, out, st, g, edge_bias=eb)
    assert [c[0].name.split("_")[0] for c in CALLS] == (["delta", "blocks", "blocks"] if g.is_implicit
                                                       else ["stats", "csr", "csr"])
    assert all(c[3][0] == addr(do) for c in CALLS[:1]) and all(c[3][:3] == (addr(q), addr(k), addr(v)) for c in CALLS[1:])

for dt in (np.float32, np.float16, np.float64):
    check_call(tg.Graph.triangular(40), dt=dt)
    check_call(tg.Graph.cu_seqlens([0, 3, 3, 70, 71]), H=4, Hkv=2, D=64, DV=64, dt=dt)
    check_call(tg.Graph.dense(30, 50), prune=0.1, dt=dt)
    check_call(tg.Graph.cu_seqlens([0, 3, 9, 20], cu_seqlens_k=[0, 7, 9, 40], causal=True), dt=dt)
    check_call(tg.Graph.band(45, 30, left=4, right=2), dt=dt)
    csr = tg.Graph.from_coo([0, 1, 2, 5, 5], [1, 2, 3, 0, 4], num_src=7, num_dst=6)
    check_call(csr, dt=dt)
    check_call(csr, dt=dt, bias=True)
# records live with their relation: a new graph (same sizes, maybe the same id) gets its own
for n in range(5):
    g = tg.Graph.from_coo(rng.integers(0, 9, 12), np.sort(rng.integers(0, 9, 12)), num_src=9, num_dst=9)
    check_call(g)
    del g
# every launch passes exactly the kernel's parameters
def n_args_ok():
    for kern, grid, block, a in CALLS:
        assert len(a) == len(kern.spec), (kern.name, len(a), len(kern.spec))

# CSR with a hub destination (every source) and a hub source (every destination): work items,
# merges after the item kernels; decode shapes: the split-key kernel and its merge
n, ns = 40, 3000
rows = np.concatenate([np.zeros(ns, np.int64), np.arange(1, n)])
cols = np.concatenate([np.arange(ns), np.zeros(n - 1, np.int64)])
hub = tg.Graph.from_coo(cols, rows, num_src=ns, num_dst=n)
q, k, v = arr(n, 2, 16), arr(ns, 1, 16), arr(ns, 1, 16)
CALLS.clear()
out, st, plan = functional.run_forward(q, k, v, hub)
names = [c[0].name for c in CALLS]
assert names[0].endswith("_items") and names[1].startswith("softmax_merge_rows"), names
assert "split into" in plan.run_info["kernel"], plan.run_info["kernel"]
n_args_ok()
CALLS.clear()
functional.run_backward(arr(n, 2, 16), q, k, v, out, st, hub)
names = [c[0].name for c in CALLS]
assert names[0].startswith("stats") and names[1].startswith("csr_dq") and names[1].endswith("_items")
assert names[2].startswith("csr_sum_merge") and "dkdv" in names[3], names
n_args_ok()
for g in (tg.Graph.dense(5000, 1), tg.Graph.cu_seqlens([0, 1, 2, 4], cu_seqlens_k=[0, 9, 900, 930])):
    q, k, v = arr(g.num_dst, 8, 64), arr(g.num_src, 2, 64), arr(g.num_src, 2, 64)
    CALLS.clear()
    out, st, plan = functional.run_forward(q, k, v, g)
    assert CALLS[0][0].name.startswith("decode_float32"), CALLS[0][0].name
    assert plan.run_info["kernel"].startswith("cuda.decode.forward"), plan.run_info["kernel"]
    grid = CALLS[0][1]
    assert grid[0] == g.realize("cuda").num_blocks and grid[1] > 1, grid  # long keys: split
    assert CALLS[1][0].name.startswith("softmax_merge_splits")
    # the split kernel writes only the partials, which the merge reads; the merge writes the
    # arrays the call returns
    dec, mrg = CALLS[0][3], CALLS[1][3]
    assert dec[6:9] == mrg[0:3], (dec[6:9], mrg[0:3])
    assert mrg[4:7] == (addr(out), addr(st.m), addr(st.l)), (mrg[4:7], addr(out))
    assert addr(out) not in dec[3:6], "the split kernel was given the output"
    n_args_ok()
print("records ok")
'''


def test_launch_records_memoised_and_correct():
    """cuda.api's memoised launch records, without a GPU: a host stand-in for cupy records each
    launch; grids follow the tile rules, operands are read in place (addresses, element
    strides), a second call launches the same thing and counts kernel-cache hits, and a new
    Graph never reuses another one's relation addresses."""
    import os
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    r = subprocess.run([sys.executable, "-c", _RECORDS_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "records ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_cubin_cache_key_follows_the_defining_file(tmp_path, monkeypatch):
    """The cubin cache key holds the hash of the file that defines the kernel: same name,
    different defining source -> different cache file; same source -> same file; caching off
    -> None."""
    _shield()
    from tiga_numba.cuda import launch
    monkeypatch.setenv("TIGA_NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("def k(): pass\n")
    b.write_text("def k(): return 1\n")
    c.write_text("def k(): pass\n")
    pa, pb, pc = (launch._cache_path("k_f32", "90", str(p)) for p in (a, b, c))
    assert pa != pb and pa == pc and pa.startswith(str(tmp_path / "cache"))
    assert launch._cache_path("k_f32", "90", str(a)) != launch._cache_path("k_f16", "90", str(a))
    monkeypatch.setenv("TIGA_NUMBA_CACHE_DIR", "0")
    assert launch._cache_path("k_f32", "90", str(a)) is None


# --------------------------------------------------------------------------- score modifiers
def _modifier_trees():
    from tiga_numba import score_mod as sm
    S = sm.SCORE
    slopes = sm.Expr("head", (), "alibi_slopes")
    da, sa = sm.Expr("node", (), ("dst", "a")), sm.Expr("node", (), ("src", "a"))
    eb = sm.Expr("edge", (), "b")
    flash = sm.alibi_tree(sm.softcap_tree(S), aligned=False)
    fields = sm.make("add", sm.make("mul", slopes, sm.Expr("tanh", (sm.make("add", S, sa),))),
                     sm.Expr("where", (sm.Expr("gt", (S, da)), sm.Expr("exp", (da,)),
                                       sm.make("mul", eb, S))))
    gat = sm.Expr("leaky_relu", (sm.make("add", sa, da), sm.const(0.2)))
    return {"flash": flash, "fields": fields, "gat": gat}


# (tree, kernels, dtype, D, DV): flash-attn's soft-cap + ALiBi in the block kernels (float16
# inputs), a tree with per-head params, dst / src / edge fields in the split-row CSR kernels
# (GQA group 2), and classic GAT (no dot product: D = 0) in the CSR kernels. Few: each PTX
# compile takes seconds.
MOD_CONFIGS = [("flash", "blocks", "float16", 64, 64), ("fields", "csr", "float32", 64, 64),
               ("gat", "csr", "float32", 0, 32)]


@pytest.mark.parametrize("tree,family,dtype,D,DV", MOD_CONFIGS,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-D{c[3]}" for c in MOD_CONFIGS])
def test_compile_ptx_sm90_score_modifiers(tree, family, dtype, D, DV):
    """The modifier's device functions are inlined into the CUDA-core kernels (forward and both
    backward passes) and compile for sm_90 without a GPU; the plain kernels' properties hold:
    lane-group shuffles, and no local memory (the gradient sums stay in registers), except the
    per-query-head src-field sums of the CSR dk/dv pass under GQA (a few floats, L1-resident)."""
    _shield()
    from tiga_numba import score_mod as sm
    from tiga_numba.cuda import blocks, csr, tiles
    from tiga_numba.cuda import score_codegen as mods
    t = _modifier_trees()[tree]
    gen = mods.generated(t, sm.Layout(t).differentiable(), tiles.acc_of(dtype))
    if family == "blocks":
        kernels = [blocks.make_forward(tiles.block_tiles("fwd", dtype, D, DV), False, gen),
                   blocks.make_dq(tiles.block_tiles("dq", dtype, D, DV), gen),
                   blocks.make_dkdv(tiles.block_tiles("dkdv", dtype, D, DV), gen)]
    else:
        cf, cb = tiles.csr_tiles("fwd", dtype, D, DV), tiles.csr_tiles("bwd", dtype, D, DV)
        kernels = [csr.make_forward(cf, False, True, gen), csr.make_dq(cb, False, True, gen),
                   csr.make_dkdv(cb, False, True, gen, 2)]
    for kern in kernels:
        assert kern.name.endswith(mods.tag(gen)) or "_grp" in kern.name, kern.name
        ptx = kern.compile_ptx(cc=(9, 0))
        assert ".target sm_90" in ptx and ".entry" in ptx, kern.name
        # one exception, by design: the CSR dk/dv pass of a GQA group > 1 keeps its src-field
        # sums per query head in a small array indexed by the (not unrolled) head loop
        if "_grp" not in kern.name or kern.name.endswith("_grp1"):
            assert "ld.local" not in ptx and "st.local" not in ptx, f"{kern.name}: local memory used"
        if D > 0:
            assert "shfl.sync" in ptx or kern.name.split("_m")[0].endswith("g1"), kern.name


def test_csr_forward_geometry_and_register_cap():
    """The CSR forward's geometry comes from tiles.csr_tiles: one edge per step, and a register
    cap of 40 (a ptxas option of the GPU build, not part of the PTX) for float32 accumulation
    without a score modifier; float64 and modified kernels keep the compiler's choice."""
    from tiga_numba.cuda import csr, tiles
    t = tiles.csr_tiles("fwd", "float16", 64, 64)
    assert (t.UE, t.REGS, t.G) == (1, 40, 16)
    kern = csr.make_forward(t, False)
    assert kern.jit_options == {"max_registers": 40} and "_ue1_r40" in kern.name
    assert ".entry" in kern.compile_ptx(cc=(9, 0))
    wide = tiles.csr_tiles("fwd", "float64", 64, 64)
    assert wide.REGS == 0 and csr.make_forward(wide, False).jit_options == {}
    bwd = tiles.csr_tiles("bwd", "float32", 64, 64)
    assert bwd.REGS == 0 and csr.make_dq(bwd, False).jit_options == {}
    import dataclasses
    capped = dataclasses.replace(bwd, REGS=48)   # the backward's kernels take a cap the same way
    for kern in (csr.make_dq(capped, False), csr.make_dkdv(capped, False)):
        assert kern.jit_options == {"max_registers": 48} and "_r48" in kern.name
        assert ".entry" in kern.compile_ptx(cc=(9, 0))


def test_linear_lowering_pass_finds_the_same_variables(monkeypatch):
    """numba_fixes.install replaces numba-cuda's quadratic `_find_singly_assigned_variable` by
    numba core's linear form: on the functions of a real kernel compile, both find the same
    (non-empty) sets of singly assigned variables."""
    _shield()
    from numba.cuda import lowering
    from tiga_numba.cuda import numba_fixes as fixes
    fixes.install()
    if fixes.replaced is None:
        pytest.skip("this numba-cuda has the linear pass: nothing replaced")
    assert lowering.Lower._find_singly_assigned_variable is fixes._fast_find_singly_assigned_variable
    compared = []

    def both(self):
        fixes.replaced(self)
        want = set(self._singly_assigned_vars)
        fixes._fast_find_singly_assigned_variable(self)
        compared.append((want, set(self._singly_assigned_vars)))

    monkeypatch.setattr(lowering.Lower, "_find_singly_assigned_variable", both)
    from tiga_numba.cuda import csr, tiles
    csr.make_sum_merge("float32", tiles.acc_of("float32"), 24).compile_ptx(cc=(9, 0))
    assert compared and any(want for want, _ in compared)
    assert all(want == got for want, got in compared)


def test_a_lowering_pass_already_linear_is_left_alone():
    _shield()
    from numba.core import lowering as core_lowering
    from tiga_numba.cuda import numba_fixes as fixes
    assert not fixes._has_quadratic_pass(core_lowering.Lower._find_singly_assigned_variable)
    fixes.install()
    if fixes.replaced is not None:
        assert fixes._has_quadratic_pass(fixes.replaced)


def test_linear_lowering_pass_on_a_variable_assigned_twice_in_its_block():
    """A hand-made function IR: x assigned twice in one block (not singly assigned), y once and
    used only there, z assigned in two blocks: both forms keep y alone."""
    _shield()
    import types as pytypes
    from numba.cuda.core import ir
    from tiga_numba.cuda import numba_fixes as fixes
    fixes.install()
    if fixes.replaced is None:
        pytest.skip("this numba-cuda has the linear pass: nothing replaced")
    loc = ir.Loc("<made>", 1)
    scope = ir.Scope(None, loc)
    var = {n: ir.Var(scope, n, loc) for n in "xyz"}
    b0, b1 = ir.Block(scope, loc), ir.Block(scope, loc)
    for name in ("x", "x", "y", "z"):
        b0.append(ir.Assign(ir.Const(1, loc), var[name], loc))
    b0.append(ir.Jump(1, loc))
    b1.append(ir.Assign(ir.Const(2, loc), var["z"], loc))
    b1.append(ir.Return(var["z"], loc))
    blocks = {0: b0, 1: b1}
    func_ir = pytypes.SimpleNamespace(blocks=blocks, func_id=pytypes.SimpleNamespace(is_generator=False))
    found = []
    for method in (fixes.replaced, fixes._fast_find_singly_assigned_variable):
        lower = pytypes.SimpleNamespace(func_ir=func_ir, blocks=blocks)
        method(lower)
        found.append(lower._singly_assigned_vars)
    assert found[0] == found[1] == {"y"}
