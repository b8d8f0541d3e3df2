"""The registry decides: plans name the chosen kernel family and every refusal, before the call;
run options are call arguments or a context, environment variables only defaults."""
import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba import registry


def _qkv(n=12, h=2, d=8):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))


def test_plan_names_family_and_refusals_before_the_call():
    q, k, v = _qkv()
    csr = tg.Graph.from_coo([0, 1, 2, 5], [1, 2, 0, 7], 12, 12)
    plan = tg.make_plan(q, k, v, csr)
    assert plan.family == "cpu.csr"
    assert dict(plan.considered)["cpu.blocks"].startswith("refused")
    text = plan.explain()
    assert "kernel family: cpu.csr" in text and "needs an implicit" in text
    assert "(not run yet)" in text
    out = tg.attention(q, k, v, csr)
    assert tg.explain().splitlines()[2] == text.splitlines()[2]
    assert out.shape == (12, 2, 8)
    assert tg.make_plan(q, k, v, tg.Graph.band(12, left=2)).family == "cpu.blocks"


def test_plan_is_frozen():
    q, k, v = _qkv()
    plan = tg.make_plan(q, k, v, tg.Graph.dense(12))
    with pytest.raises(Exception):
        plan.family = "cuda.tc"


def test_options_are_arguments_and_contexts():
    q, k, v = _qkv()
    g = tg.Graph.triangular(12)
    assert tg.make_plan(q, k, v, g, op="backward").options.deterministic is True
    assert tg.make_plan(q, k, v, g, op="backward", deterministic=False).options.deterministic is False
    with tg.options(deterministic=False, wgmma=False):
        p = tg.make_plan(q, k, v, g, op="backward")
        assert not p.options.deterministic and not p.options.wgmma
        # the call's keyword wins over the context
        assert tg.make_plan(q, k, v, g, op="backward", deterministic=True).options.deterministic
    assert tg.make_plan(q, k, v, g).options.wgmma is True
    with pytest.raises(TypeError, match="unknown option"):
        tg.options(fast=True)   # at the call, before any with
    with pytest.raises(TypeError, match="True or False"):
        tg.options(deterministic=1)
    block = tg.options(deterministic=False)   # made here, applied when entered
    assert tg.make_plan(q, k, v, g, op="backward").options.deterministic is True
    with block:
        assert tg.make_plan(q, k, v, g, op="backward").options.deterministic is False
    out, st = tg.attention(q, k, v, g, return_stats=True)
    a = tg.attention_backward(out, q, k, v, out, st, g, deterministic=False)
    b = tg.attention_backward(out, q, k, v, out, st, g)
    for x, y in zip(a, b):  # the CPU backward is deterministic either way
        assert np.array_equal(x, y)


def test_poison_outputs_is_a_debug_option_the_plan_records(monkeypatch):
    """poison_outputs (NaN-filled outputs on the CUDA-core kernels, a debugging aid) is an
    ordinary run option: off by default, on in a context, shown by explain();
    TIGA_NUMBA_POISON_OUTPUTS=1 sets its default (read once, when run_options is loaded)."""
    from tiga_numba import run_options
    q, k, v = _qkv()
    g = tg.Graph.triangular(12)
    assert tg.make_plan(q, k, v, g).options.poison_outputs is False
    with tg.options(poison_outputs=True):
        plan = tg.make_plan(q, k, v, g)
        assert plan.options.poison_outputs is True
        assert "poison_outputs=True" in plan.explain()
    monkeypatch.setenv("TIGA_NUMBA_POISON_OUTPUTS", "1")
    assert run_options._env_flag("TIGA_NUMBA_POISON_OUTPUTS", default=False) is True
    monkeypatch.delenv("TIGA_NUMBA_POISON_OUTPUTS")
    assert run_options._env_flag("TIGA_NUMBA_POISON_OUTPUTS", default=False) is False
    for value, want in (("false", False), ("OFF", False), ("no", False), ("0", False),
                        ("true", True), ("On", True), ("yes", True), ("1", True)):
        monkeypatch.setenv("TIGA_NUMBA_DETERMINISTIC", value)
        assert run_options._env_flag("TIGA_NUMBA_DETERMINISTIC") is want, value
    monkeypatch.setenv("TIGA_NUMBA_DETERMINISTIC", "fasle")
    with pytest.warns(RuntimeWarning, match="TIGA_NUMBA_DETERMINISTIC"):
        assert run_options._env_flag("TIGA_NUMBA_DETERMINISTIC") is True   # the default holds


def test_every_family_lives_in_the_registry():
    names = [f.name for f in registry.families()]
    for want in ("cuda.tc", "cuda.blocks", "cuda.csr", "cpu.blocks", "cpu.csr", "cpu.gat",
                 "cuda.gat", "cpu.neighbors", "cuda.neighbors"):
        assert want in names
    assert [f.name for f in registry.families("forward", "cuda")] == [
        "cuda.decode", "cuda.tc", "cuda.blocks", "cuda.csr"]
    # the backward of few-query blocks is parallel over key tiles already: no decode family
    assert [f.name for f in registry.families("backward", "cuda")] == [
        "cuda.tc", "cuda.blocks", "cuda.csr"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.families()[0])


def test_no_family_raises_with_every_refusal():
    req = registry.Request(op="gat.forward", backend="cuda", relation_kind="band", implicit=True,
                           banded=True, score="network", dtype="float32")
    with pytest.raises(NotImplementedError) as err:
        registry.choose(req)
    msg = str(err.value)
    assert "cuda.gat" in msg and "score networks run over CSR relations" in msg


def test_score_modifiers_and_bands_route_with_the_refusals_stated():
    req = registry.Request(op="forward", backend="cuda", relation_kind="band", implicit=True,
                           banded=True, score="modified: f = softcap(s)", modified=True,
                           dtype="float16", max_block_rows=4, probe=lambda: (lambda r: None))
    got = registry.choose(req)
    assert got.family.name == "cuda.tc"   # banded blocks and modifiers are compiled into the tc kernels
    assert "score modifiers are not compiled into the split-key kernel" in dict(got.considered)["cuda.decode"]
    pruned = registry.choose(registry.Request(op="forward", backend="cuda", relation_kind="band", implicit=True,
                                              banded=True, score="dot", dtype="float16", max_block_rows=64,
                                              pruned=True, probe=lambda: (lambda r: None)))
    assert pruned.family.name == "cuda.blocks"
    assert "tile pruning is not compiled into the banded tensor-core kernels" in dict(pruned.considered)["cuda.tc"]
    csr = registry.choose(registry.Request(op="backward", backend="cuda", relation_kind="csr",
                                           score="modified: f = softcap(s)", modified=True,
                                           dtype="float32"))
    assert csr.family.name == "cuda.csr"


def test_cuda_tensor_core_refusals_are_stated():
    base = dict(op="forward", backend="cuda", relation_kind="dense", implicit=True, score="dot",
                dtype="float16", max_block_rows=64, options=tg.Options())
    off = registry.choose(registry.Request(**{**base, "options": tg.Options(tensor_cores=False)}))
    assert off.family.name == "cuda.blocks"
    assert "tensor_cores=False" in dict(off.considered)["cuda.tc"]
    assert "more than 8 query rows" in dict(off.considered)["cuda.decode"]
    probe = registry.choose(registry.Request(**base, probe=lambda: (lambda req: None)))
    assert probe.family.name == "cuda.tc"
    fp32 = registry.choose(registry.Request(**{**base, "dtype": "float32",
                                               "options": tg.Options(fp32_tensor_cores=False)},
                                            probe=lambda: (lambda req: None)))
    assert fp32.family.name == "cuda.blocks"


def test_decisions_are_kept_and_keyed_on_what_the_device_probe_reads(monkeypatch):
    """A CUDA decision is made once and looked up by the next call of the same kind: one made
    without the tensor-core device probe (here the decode family, tried before the tensor cores)
    and one that asked the probe alike; the latter is keyed on what the probe reads beyond the
    relation, dtypes and head dims (the device, the scale's sign, sizes, head grouping), so a
    call on another device or with a scale the kernels refuse asks the probe again."""
    from tiga_numba import dispatch
    from tiga_numba.arrays import AttentionShape
    from tiga_numba.cuda.tc import device
    monkeypatch.setattr(dispatch, "_DECISIONS", {})
    asked, chosen = [], []

    def fake_probe(backend, graph, arrays, scale, score, probed):
        if arrays is None:   # as the real one: nothing to probe
            return None

        def probe():
            probed.append(True)
            asked.append(graph.kind)
            # the tensor cores accept a positive scale (as admission.supports does)
            return lambda req: None if scale > 0 else "scale"
        return probe
    monkeypatch.setattr(dispatch, "_device_probe", fake_probe)
    dev = [0]
    monkeypatch.setattr(device, "current_device", lambda: dev[0])
    real_choose = registry.choose
    monkeypatch.setattr(registry, "choose", lambda req: chosen.append(req.relation_kind) or real_choose(req))

    def plan(graph, scale=0.125):
        shape = AttentionShape("cupy", np.dtype(np.float16), graph.num_dst, graph.num_src, 4, 2,
                               64, 64, False)
        return dispatch.make_plan("forward", graph, shape, scale, arrays=(None, None, None))

    facts = []
    real_facts = dispatch._probe_facts
    monkeypatch.setattr(dispatch, "_probe_facts", lambda *a: facts.append(1) or real_facts(*a))
    decode = tg.Graph.dense(4096, 2)        # two query rows: the split-key family, no probe
    for _ in range(3):
        assert plan(decode).family == "cuda.decode"
    assert chosen == ["dense"] and asked == [] and facts == []
    chosen.clear()
    full = tg.Graph.dense(4096, 512)
    # a plan without arrays (explain() before a call) cannot probe: the CUDA cores, kept apart
    shape = AttentionShape("cupy", np.dtype(np.float16), 512, 4096, 4, 2, 64, 64, False)
    assert dispatch.make_plan("forward", full, shape, 0.125).family == "cuda.blocks"
    chosen.clear()
    # the tensor cores: the probe once, then the lookup
    for _ in range(3):
        assert plan(full).family == "cuda.tc"
    assert chosen == ["dense"] and asked == ["dense"]
    assert plan(full, scale=0.5).family == "cuda.tc" and asked == ["dense"]   # same facts
    assert plan(full, scale=-0.5).family == "cuda.blocks" and asked == ["dense"] * 2
    dev[0] = 1                              # another device: asked again
    assert plan(full).family == "cuda.tc" and asked == ["dense"] * 3
    assert plan(full).family == "cuda.tc" and asked == ["dense"] * 3
