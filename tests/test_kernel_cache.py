"""tiga_numba.kernel_cache: where a call's kernel came from (memory / disk / compiled), the
first-compile notice, and tiga_numba.precompile."""
import collections
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from numba import prange

import tiga_numba as tg
from tiga_numba import kernel_cache
from tiga_numba.kernel_cache import KernelCache, KernelSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeDispatcher:
    """Stands in for a numba dispatcher: only the disk-cache counters KernelSource reads."""

    def __init__(self):
        self.overloads = {}
        self.hits = collections.Counter()
        self.misses = collections.Counter()

    @property
    def stats(self):
        return collections.namedtuple("Stats", "cache_path cache_hits cache_misses")(
            None, self.hits, self.misses)


@pytest.mark.parametrize("event, expected", [("compile", "compiled"), ("load", "disk hit"),
                                             (None, "memory hit")])
def test_kernel_source_reads_the_counters_after_the_launch(event, expected):
    d = FakeDispatcher()
    d.misses["old signature"] = 1  # compiled before the lookup: not this call's doing
    src = KernelSource(d, memory_hit=event is None)
    if event == "compile":
        d.misses["(float32[:, :, ::1],)"] += 1
    elif event == "load":
        d.hits["(float32[:, :, ::1],)"] += 1
    assert src.text == expected and str(src) == expected and f"{src}" == expected
    assert src == expected and src != "miss"


def test_kernel_source_finds_dispatchers_in_tuples_and_modules():
    a, b, c = FakeDispatcher(), FakeDispatcher(), FakeDispatcher()
    module = type(sys)("generated_kernels")
    module.forward, module.backward, module.not_a_kernel = b, c, 3
    assert kernel_cache.dispatchers_in((a, [b])) == [a, b]
    assert kernel_cache.dispatchers_in(module) == [b, c]
    src = KernelSource((a, module), memory_hit=False)
    c.hits["sig"] += 1
    assert src.text == "disk hit"


def _fresh_kernel(cache, family):
    # a new function object per call: numba compiles it (no disk cache: cache=False)
    return cache.get((family, "probe", "float64"), lambda: numba.njit(lambda x: x + 1.5))


def test_first_compile_of_a_family_prints_one_notice(capfd, monkeypatch):
    monkeypatch.delenv("TIGA_NUMBA_QUIET", raising=False)
    cache = KernelCache()
    family = f"test{os.getpid()}a"
    kern = _fresh_kernel(cache, family)
    src = kernel_cache.source(kern, cache.last_was_hit)
    assert kern(1.0) == 2.5
    assert src == "compiled"
    kern2 = cache.get((family, "probe", "int64"), lambda: numba.njit(lambda x: x * 2))
    assert kern2(3) == 6  # second compile of the same family: no second line
    err = capfd.readouterr().err
    assert err.count(f"tiga_numba: compiling {family} probe kernels (once; cached on disk)") == 1
    assert kernel_cache.source(kern, True) == "memory hit"


def test_quiet_silences_the_notice(capfd, monkeypatch):
    monkeypatch.setenv("TIGA_NUMBA_QUIET", "1")
    cache = KernelCache()
    kern = _fresh_kernel(cache, f"test{os.getpid()}b")
    assert kern(0.5) == 2.0
    assert "tiga_numba: compiling" not in capfd.readouterr().err


_CALL = """
import numpy as np, tiga_numba as tg
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((64, 2, 16)).astype(np.float32) for _ in range(3))
g = tg.Graph.dense(64)
tg.attention(q, k, v, g)
print("first:", tg.functional.last_plan().run_info["cache"])
tg.attention(q, k, v, g)
print("second:", tg.functional.last_plan().run_info["cache"])
print(tg.explain())
"""


def test_a_new_process_reports_a_disk_hit():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TIGA_NUMBA_QUIET="1")
    runs = [subprocess.run([sys.executable, "-c", _CALL], cwd=ROOT, env=env, text=True,
                           capture_output=True, timeout=600) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (proc.stdout for proc in runs)
    assert "first: compiled" in first or "first: disk hit" in first, first
    # the first process left the kernel in numba's disk cache: the second one loads it
    assert "first: disk hit" in second and "second: memory hit" in second, second
    assert "kernel cache: this call memory hit" in second


def test_precompile_runs_and_then_everything_is_in_memory(capsys):
    from tiga_numba import precompile

    assert precompile.main(["--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "tiga_numba.precompile: CPU kernels for float32" in out and "done in" in out
    records = precompile.precompile(["float32"])
    assert [r[1] for r in records] == ["blocks forward, dense",
                                       "blocks forward, causal / segments / wide bands",
                                       "blocks forward, narrow bands (span tiles)",
                                       "blocks backward, narrow bands (span tiles)",
                                       "blocks forward, tile-pruned", "blocks backward",
                                       "decode forward (few query rows per block)",
                                       "csr forward", "csr backward"]
    assert all(r[0] == "float32" and r[2] == "memory hit" for r in records), records
    # each call reaches the family its label names (the block calls have more rows than the
    # split-key decode kernel takes, which would otherwise be chosen)
    for label, run in precompile._calls("float32"):
        plan = run()
        want = "cpu.decode" if label.startswith("decode") else "cpu.csr" if label.startswith("csr") else "cpu.blocks"
        assert plan.family == want, (label, plan.family)
    # the narrow-band calls' relation takes span tiles under the machine's tile rule (the suite
    # pins its own tiles, which have none; a plan, made without compiling anything)
    n, narrow = precompile._narrow_band()
    x = np.zeros((n, 1, 4), np.float32)
    with tg.options(cpu_tiles=None):
        for op in ("forward", "backward"):
            assert "spanning" in tg.make_plan(x, x, x, narrow, op=op).explain(), op
    with pytest.raises(SystemExit):
        precompile.main(["--modifiers", "rope"])


def test_precompile_modifiers_reach_every_modified_kernel_kind(monkeypatch):
    """--modifiers softcap,alibi asks for the forward kernels a user's modified calls need: the
    dense forward's taller tiles as well as the others', and ALiBi's bottom-right aligned tree
    (rectangular dense / cu_seqlens blocks) as well as the plain one. The first kernel lookup of
    each call is recorded and the call stopped there (no compile)."""
    from tiga_numba import precompile
    from tiga_numba.cpu import api

    class Looked(Exception):
        pass
    keys = []

    def record(key, build):
        keys.append(key)
        raise Looked

    monkeypatch.setattr(api, "_kernel", record)
    import tiga_numba as tg
    with tg.options(cpu_tiles=None):   # the machine's rule (the suite fixes the tiles otherwise)
        for label, run in precompile._calls("float64", ("softcap", "alibi"))[:8]:
            with pytest.raises(Looked):
                run()
    blocks = [k for k in keys if k[1] == "blocks.forward"]
    tiles = {name: {k[3:5] for k in blocks if name in repr(k)} for name in ("tanh", "alibi")}
    assert len(tiles["tanh"]) >= 2 and len(tiles["alibi"]) >= 2, tiles   # dense's tiles and the others'
    assert any("_alibi_shift" in repr(k) for k in blocks)                  # the aligned tree
    assert any(k[1] == "csr.forward" and "tanh" in repr(k) for k in keys)
    # per-sequence slopes: a per-row slope field, on square and rectangular (aligned) sequences
    keys.clear()
    for label, run in precompile._calls("float64", ("alibi-rows",))[:2]:
        with pytest.raises(Looked):
            run()
    assert keys and all("_alibi_slopes" in repr(k) for k in keys), keys
    assert {"_alibi_shift" in repr(k) for k in keys} == {True, False}, keys
    with pytest.raises(ValueError, match="dtypes"):
        precompile.precompile([np.int32])


def test_kernel_drivers_are_named_apart_on_disk():
    """The CPU kernels' parallel drivers call a per-item body bound by name (score_codegen.
    jit_driver); numba's disk cache keys a driver on its qualified name, so that name must differ
    with everything the body was made with (tile shape, dtype, options) and stay the same for the
    same arguments (a later process then loads, not recompiles); the body is compiled without
    numba's parallel passes, the driver with them."""
    from tiga_numba.cpu import blocks, csr

    def name(kern):
        return kern.py_func.__qualname__

    same = [name(blocks.make_forward("float32", 64, 128, False)) for _ in range(2)]
    assert same[0] == same[1]
    others = {name(blocks.make_forward("float32", 32, 128, False)),
              name(blocks.make_forward("float32", 64, 64, False)),
              name(blocks.make_forward("float64", 64, 128, False)),
              name(blocks.make_forward("float32", 64, 128, True)),
              name(blocks.make_forward("float32", 64, 128, False, own=True))}
    assert len(others | {same[0]}) == 6
    assert name(blocks.make_backward("float32", 64, 128)) != name(blocks.make_backward("float32", 32, 128))
    assert name(csr.make_forward("float32")) != name(csr.make_forward("float64"))
    dst, src = csr.make_backward("float32")
    assert name(dst) != name(src)
    kern = blocks.make_forward("float32", 64, 128, False)
    assert kern.targetoptions.get("parallel") is True
    item = kern.py_func.__globals__["FORWARD_ITEM"]
    assert item.targetoptions.get("parallel") is False
    # the items compile first (jit_driver loads them before the driver): the kernel's dispatchers,
    # which the first-compile notice and the memory / disk / compiled report watch, include them
    held = kernel_cache.dispatchers_in(kern)
    merge = kern.py_func.__globals__["MERGE_ITEM"]
    assert held[0] is kern and sorted(map(id, held[1:])) == sorted((id(item), id(merge)))
    # the bodies too: numba's symbol names come from the qualified name, so two variants of one
    # body loaded from the disk cache into one process must not share it
    items = {name(blocks.make_forward(*args).py_func.__globals__["FORWARD_ITEM"])
             for args in (("float32", 64, 128, False), ("float32", 32, 128, False),
                          ("float64", 64, 128, True), ("float64", 512, 256, False))}
    assert len(items) == 4


_VARIANTS = """
import sys
import numpy as np, tiga_numba as tg
from tiga_numba import reference
rng = np.random.default_rng(0)
q = rng.standard_normal((128, 1, 4)); k = rng.standard_normal((384, 1, 4)); v = rng.standard_normal((384, 1, 3))
g = tg.Graph.dense(384, 128)
for step in sys.argv[1:]:
    if step == "exact":
        got, want = tg.attention(q, k, v, g), reference.attention(q, k, v, g)
    else:
        got = tg.attention(q, k, v, g, block_prune_threshold=0.3)
        want = reference.pruned_attention(q, k, v, g, rho=0.3, block_m=64, block_n=128)
    print(step, "ok" if np.abs(got - want).max() < 1e-12 else f"WRONG by {np.abs(got - want).max()}")
"""


def test_variants_compiled_in_two_processes_keep_their_code_when_loaded_together(tmp_path):
    """The float64 dense forward at its exact tile shape and at the pruning rule's, each compiled
    by its own process into a fresh numba cache, then both loaded from that cache by a third
    process: each call must run its own variant (the two item bodies once had one symbol name,
    and the second driver loaded ran the first one's body: wrong numbers, and BLAS errors)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TIGA_NUMBA_QUIET="1", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env["TIGA_NUMBA_CPU_TILES"] = "512x256"   # the exact call's tiles; the pruned one keeps its rule's 64 x 128
    for steps in (["exact"], ["pruned"], ["pruned", "exact"], ["exact", "pruned"]):
        proc = subprocess.run([sys.executable, "-c", _VARIANTS, *steps], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split() == [x for step in steps for x in (step, "ok")], proc.stdout + proc.stderr[-2000:]


def test_generated_modules_survive_a_damaged_file_and_a_read_only_folder(tmp_path, monkeypatch):
    """disk_cache.import_source: a module file under the digest's name that does not hold the
    source (emptied, cut short) is written again, never imported as is; a cache folder that
    exists but cannot be written falls back to a private folder (the import still works)."""
    import os
    import sys
    from tiga_numba import disk_cache
    monkeypatch.setenv("TIGA_NUMBA_CACHE_DIR", str(tmp_path))
    source = "VALUE = 41\n\ndef f():\n    return VALUE + 1\n"
    mod = disk_cache.import_source(source, "tiga_test_mod", "gen")
    path = mod.__file__
    assert mod.f() == 42 and path.startswith(str(tmp_path))
    del sys.modules[mod.__name__]
    with open(path, "w") as fh:
        fh.write("VALUE = 41\n")        # cut short: f is missing
    mod = disk_cache.import_source(source, "tiga_test_mod", "gen")
    assert mod.f() == 42
    del sys.modules[mod.__name__]
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).startswith(str(tmp_path)) else real_access(p, mode))
    mod = disk_cache.import_source(source + "# other\n", "tiga_test_mod", "gen")
    assert mod.f() == 42 and not mod.__file__.startswith(str(tmp_path))
    del sys.modules[mod.__name__]



def test_tensor_core_kernel_text_survives_a_damaged_file(tmp_path, monkeypatch):
    """The tensor-core builder's generated file (cuda/tc/build.py) follows the same rule: a file
    under the text's digest that does not hold the text is written again, never imported."""
    import sys
    pytest.importorskip("numba_cuda")
    from tiga_numba.cuda.tc import build
    monkeypatch.setenv("TIGA_NUMBA_CACHE_DIR", str(tmp_path))
    src = "def kernel():\n    return 7\n"
    assert build._load_cached_module("tc_test_text", src, "float16")() == 7
    (path,) = (tmp_path / "tc").glob("tc_test_text_*.py")
    for name in [m for m in sys.modules if m.startswith("_tiga_tc_tc_test_text_")]:
        del sys.modules[name]
    path.write_text("def kernel():\n    return 0\n")   # another text under this digest's name
    assert build._load_cached_module("tc_test_text", src, "float16")() == 7
    assert path.read_text().endswith(src)


def test_tensor_core_launch_records_are_made_again_when_a_tuning_table_changes(monkeypatch):
    """cuda/tc/api._launch_memo: one launch record per call shape, its kernels counted as cache
    hits when reused (and said so in the run_info it records), and made again when what the tuning tables say for it changes: an entry
    replaced or edited in place, a NARROW or MODIFIED change added or removed, the narrow-band
    limit moved (the tuning probes do each of these at run time)."""
    import types as _t
    from tiga_numba.cuda.tc import api, tuning
    monkeypatch.setitem(tuning.TUNING_WGMMA, ("fwd", 128), dict(tuning.TUNING_WGMMA[("fwd", 128)]))
    monkeypatch.setattr(tuning, "NARROW", dict(tuning.NARROW))
    monkeypatch.setattr(tuning, "MODIFIED", dict(tuning.MODIFIED))
    rec = {"tables": {}}
    made = []

    def build():
        made.append(api._Launch())
        made[-1].cache, made[-1].info = "miss", {"kernel": f"record {len(made)}"}
        return made[-1]

    def launch():
        entries = tuning.table_entries("float16", True, ("fwd",), 128)
        return api._launch_memo(rec, ("fwd-launch", "float16", 128), entries, build)
    hits = api.KERNELS.hits
    first = launch()
    said = [_t.SimpleNamespace(run_info={}) for _ in range(2)]
    first.record(said[0], ["a copy"])                            # the call that made the record
    assert said[0].run_info == {"kernel": "record 1", "copies": ["a copy"], "cache": "miss"}
    assert launch() is first and first.uses == 2 and api.KERNELS.hits == hits + 1 and len(made) == 1
    first.record(said[1], [])                                    # a later call: its kernels were hits
    assert said[1].run_info == {"kernel": "record 1", "copies": [], "cache": "hit"}
    tuning.TUNING_WGMMA[("fwd", 128)]["BN"] = 32                 # edited in place
    second = launch()
    assert second is not first and len(made) == 2 and launch() is second
    tuning.TUNING_WGMMA[("fwd", 128)] = dict(tuning.TUNING_WGMMA[("fwd", 128)], NW=4)   # replaced
    assert launch() is not second and len(made) == 3
    tuning.NARROW.clear()                                         # a narrow-band change removed
    assert launch() is made[-1] and len(made) == 4
    tuning.MODIFIED[("wgmma", "fwd", 128)] = {"BN": 64}           # a modifier change added
    assert launch() is made[-1] and len(made) == 5
    monkeypatch.setattr(tuning, "NARROW_KEYS", -1)                # the narrow-band limit moved
    assert launch() is made[-1] and len(made) == 6
    assert launch() is made[-1] and len(made) == 6                # and now kept again


def test_tensor_core_launch_records_hold_the_variants_a_call_shape_takes(monkeypatch):
    """cuda/tc/api._forward_call / _backward_call without a GPU (kernels, schedule uploads and
    addresses stubbed): a window of 128 keys at D = 128 on wgmma takes the narrow-band shape in
    the forward and the dQ kernel, the record carries its kernels, schedules and explain() words,
    and a soft-cap tree reaches both backward variants (two kernels, no fused dQ)."""
    import types as _t
    import tiga_numba as tg
    from tiga_numba import score_mod as sm
    from tiga_numba.cuda.tc import api, tuning

    def stub(name):
        return _t.SimpleNamespace(name=name, llvm=lambda: "", ptx=lambda: "")
    monkeypatch.setattr(api, "kernel", lambda v: (stub(v.kind), "miss"))
    monkeypatch.setattr(api, "delta_kernel", lambda dt, dv: stub("delta"))
    monkeypatch.setattr(api, "_work", lambda rec, which, BM: ((which, BM), 7))
    monkeypatch.setattr(api, "_ptr", lambda work: 4096)
    rec = api._host_record(tg.Graph.band(600, left=127)._blocks)
    fwd = api._forward_call(rec, "float16", 128, 128, True, None, None, False)
    assert (fwd.vr.NW, fwd.vr.BN) == (4, 64) and fwd.vr.wgmma and not fwd.vr.prune
    assert (fwd.kern.name, fwd.cache, fwd.W, fwd.workp) == ("fwd", "miss", 7, 4096)
    assert 0 < fwd.visited < fwd.total and tuning.NARROW_WORDS in fwd.info["tiles"]
    bwd = api._backward_call(rec, "float16", 600, 600, 128, 128, True, True, None, None)
    assert (bwd.vq.NW, bwd.vq.BN) == (4, 64) and bwd.main is bwd.kq and bwd.kd.name == "delta"
    assert "dQ by query tiles" in bwd.info["kernel"] and tuning.NARROW_WORDS in bwd.info["tiles"]
    cap = sm.bind_flash(30.0, None, None)
    gmod = api._modifier_for(cap, "float16", 128 ** -0.5)
    mod = api._backward_call(rec, "float16", 600, 600, 128, 128, True, True, cap, gmod)
    assert mod.vq.mod is gmod and mod.vk.mod is gmod and not mod.vk.fuse_dq
    assert "score modifier compiled in" in mod.info["kernel"] and gmod.fold_words in mod.info["kernel"]
    causal = api._host_record(tg.Graph.triangular(300)._blocks)
    pruned = api._forward_call(causal, "float16", 128, 128, True, None, None, True)
    assert pruned.vr.prune and "tile pruning" in pruned.info["kernel"]
    assert tuning.NARROW_WORDS not in pruned.info["tiles"]   # no band: the shipped shape


_BITS = """
import gc, hashlib
import numpy as np, tiga_numba as tg
from numba.core.registry import CPUDispatcher
rng = np.random.default_rng(0)
g = tg.Graph.triangular(700)
q, k, v, do = (rng.standard_normal((700, 2, 16)).astype(np.float32) for _ in range(4))
out, st = tg.attention(q, k, v, g, return_stats=True)
grads = tg.attention_backward(do, q, k, v, out, st, g)
print(*(hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest()[:12] for x in (out, st.m, st.l, *grads)))
drivers = [d for d in gc.get_objects() if isinstance(d, CPUDispatcher) and d.overloads
           and d.py_func.__module__ == "tiga_numba.cpu.blocks" and d.targetoptions.get("parallel")]
items = {id(x): x for d in drivers for name, x in d.py_func.__globals__.items()
         if name.endswith(("_ITEM", "_PART")) and isinstance(x, CPUDispatcher)}
print("drivers", len(drivers), "items", len(items), "overloads per item", sorted({len(x.overloads) for x in items.values()}))
"""


def test_a_process_loading_the_kernels_computes_the_bits_of_the_one_that_compiled_them(tmp_path):
    """numba links a weak copy of each work item into its parallel driver; before jit_driver
    loaded the items first, a process that loaded a block kernel from the disk cache ran that
    copy and the compiling process the item's own code, and the block kernels' outputs differed
    in the last bits between them. Fresh caches: the first process compiles, the second loads;
    same bits for a causal block call, forward and backward, and each item compiled for one
    signature only (the one its driver calls). (benchmarks/tuning/cache_bits_probe.py checks
    every kernel family this way, CSR with split rows and soft-caps included.)"""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TIGA_NUMBA_QUIET="1", NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               TIGA_NUMBA_CACHE_DIR=str(tmp_path / "tiga"), NUMBA_NUM_THREADS="2")
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _BITS], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(proc.stdout.splitlines())
    assert runs[0] == runs[1], "\n".join(runs[0] + ["-- loaded:"] + runs[1])
    assert runs[0][-1].endswith("overloads per item [1]"), runs[0][-1]
    assert " items 3 " in runs[0][-1], runs[0][-1]   # fwd (item, merge), bwd (part)


#: the stand-in a test driver's call resolves to until jit_driver binds the item
DOUBLE_ITEM = None


def _double_item(i, x, out):
    out[i] = 2.0 * x[i]


def _double_item_by_other_names(i, values, out):
    out[i] = 2.0 * values[i]


def _double_driver(x, out):
    for i in prange(x.shape[0]):
        DOUBLE_ITEM(np.int64(i), x, out)   # signed, as the package's drivers pass it


def test_a_work_item_takes_its_index_then_driver_arguments_by_name():
    """jit_driver compiles or loads each item for its own signature before the driver, which it
    reads from the driver's argument types by the item's parameter names: an item whose names are
    not the driver's cannot be typed that way and is refused when the kernel is made, naming it;
    one that follows the rule is compiled for exactly (int64, the driver's types of its names)."""
    from numba import types

    from tiga_numba.cpu.score_codegen import jit_driver, jit_kernel

    with pytest.raises(TypeError, match=r"DOUBLE_ITEM takes \['values'\].*_double_driver"):
        jit_driver(_double_driver, None, {},
                   DOUBLE_ITEM=jit_kernel(_double_item_by_other_names, None, parallel=False))
    item = jit_kernel(_double_item, None, parallel=False)
    driver = jit_driver(_double_driver, None, {}, DOUBLE_ITEM=item)
    x = np.random.default_rng(3).standard_normal(7)
    out = np.full(7, np.nan)
    driver(x, out)
    np.testing.assert_array_equal(out, 2.0 * x)
    arr = types.Array(types.float64, 1, "C")
    assert list(item.overloads) == [(types.int64, arr, arr)]
