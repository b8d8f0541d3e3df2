"""Score modifiers in the tensor-core kernels, on the numpy warp emulator (no GPU): forward and
two-kernel backward (dq, dk, dv) against a float64 oracle that evaluates the same tree, for
soft-cap, ALiBi (bottom-right aligned through a dst field), a piecewise score with comparisons,
np.where, leaky_relu and a src field, and a window written as -inf scores (rows whose every
score is -inf included); mma.sync and wgmma, float16 / bfloat16 / float32, GQA, tails, empty
blocks."""
import dataclasses

import numpy as np
import pytest

import tiga_numba  # noqa: F401  (first: shields tiga_numba.cuda from numba-cuda's import redirector)
from tiga_numba import score_mod as sm
from tiga_numba.cuda.tc import emulator as E
from tiga_numba.cuda.tc import generator as G
from tiga_numba.cuda.tc.generator.modifier import CEIL, TANH, Modifier

from test_tc_emulator import RELATIONS, TOL, _inputs, rel, rounded

S = sm.SCORE
DST, SRC = sm.Expr("index", (), "dst"), sm.Expr("index", (), "src")


def _softcap():
    return sm.softcap_tree(S), {sm.Expr("scalar", (), "softcap"): 2.0}


def _alibi():
    tree = sm.alibi_tree(S, aligned=True)
    return tree, {sm.Expr("head", (), "alibi_slopes"): None, sm.Expr("node", (), ("dst", "_alibi_shift")): None}


def _piecewise():
    b = sm.Expr("node", (), ("src", "b"))
    far = sm.make("gt", sm.make("sub", DST, SRC), sm.const(20.0))
    tree = sm.make("add", sm.make("where", far, sm.make("sub", S, sm.const(1.5)),
                                  sm.make("leaky_relu", S, sm.const(0.2))), b)
    return tree, {b: None}


def _window():
    far = sm.make("gt", sm.make("sub", DST, SRC), sm.const(8.0))
    return sm.make("where", far, sm.const(-np.inf), S), {}


def _nan_far():
    """NaN scores (log of a negative number) beyond 8 keys back, with a finite derivative: a NaN
    value masks the edge (never a NaN in the output)."""
    far = sm.make("gt", sm.make("sub", DST, SRC), sm.const(8.0))
    nan = sm.make("log", sm.make("sub", sm.make("neg", sm.make("abs", S)), sm.const(1.0)))
    return sm.make("where", far, nan, S), {}


def _nan_far_sqrt():
    """As _nan_far with a NaN derivative too (sqrt of a negative number): the masked cell has no
    gradient (P = 0 times f' = NaN made dS NaN)."""
    far = sm.make("gt", sm.make("sub", DST, SRC), sm.const(8.0))
    nan = sm.make("sqrt", sm.make("sub", sm.make("neg", sm.make("abs", S)), sm.const(1.0)))
    return sm.make("where", far, nan, S), {}


def _scalar_fns():
    """np.tanh, np.minimum and a comparison of a scalar param inside the tree (cell-invariant:
    hoisted out of the cells): s tanh(c) + where(c > 1, s, -s) + 0.1 min(c, 2)."""
    c = sm.Expr("scalar", (), "c")
    tree = sm.make("add", sm.make("add", sm.make("mul", S, sm.make("tanh", c)),
                                  sm.make("where", sm.make("gt", c, sm.const(1.0)), S, sm.make("neg", S))),
                   sm.make("mul", sm.const(0.1), sm.make("minimum", c, sm.const(2.0))))
    return tree, {c: 2.5}


def _nan_capped():
    """A soft-cap whose tanh argument is NaN beyond 8 keys back: the folded kernel's one-bound
    clamp (clamps.atleast) must still mask those cells (no NaN in the output or the gradients)."""
    far = sm.make("gt", sm.make("sub", DST, SRC), sm.const(8.0))
    nan = sm.make("log", sm.make("sub", sm.make("neg", sm.make("abs", S)), sm.const(1.0)))
    c = sm.Expr("scalar", (), "softcap")
    tree = sm.make("mul", c, sm.make("tanh", sm.make("div", sm.make("where", far, nan, S), c)))
    return tree, {c: 3.0}


def _nan_shift_capped():
    """A soft-cap whose tanh argument gets a NaN term beyond 8 keys back that does not depend on
    the score: f'(z) keeps a static bound (1 - tanh^2), so the folded backward takes a NaN f' to a
    finite one by one max.f32 (Modifier.deriv_bound) instead of testing the value."""
    far = sm.make("gt", sm.make("sub", DST, SRC), sm.const(8.0))
    nan = sm.make("log", sm.make("sub", sm.make("neg", sm.make("abs", sm.make("sub", DST, SRC))), sm.const(1.0)))
    c = sm.Expr("scalar", (), "softcap")
    shift = sm.make("where", far, nan, sm.const(0.0))
    tree = sm.make("mul", c, sm.make("tanh", sm.make("add", sm.make("div", S, c), shift)))
    return tree, {c: 3.0}


def _ceiling():
    """Up to four cells a row held at the ceiling (values above 1e30) with a constant f' (1): their
    f' must be 0 where P is not (two such cells share a row's weight, so dP - Delta is not 0)."""
    near = sm.make("lt", sm.make("sub", DST, SRC), sm.const(4.0))
    return sm.make("add", S, sm.make("where", near, sm.const(2e30), sm.const(0.0))), {}


def _alibi_nan_inf():
    """ALiBi over a score that is NaN beyond 8 keys back and +inf 3 keys back: on a causal relation
    the forward splits the distance (modifier.Split) and its guarded softmax masks the NaN cells
    and ties the infinite ones at the ceiling (one per row: its weight is 1)."""
    d = sm.make("sub", DST, SRC)
    nan = sm.make("log", sm.make("sub", sm.make("neg", sm.make("abs", S)), sm.const(1.0)))
    inner = sm.make("where", sm.make("gt", d, sm.const(8.0)), nan,
                    sm.make("where", sm.make("eq", d, sm.const(3.0)), sm.const(np.inf), S))
    return sm.alibi_tree(inner, aligned=False), {sm.Expr("head", (), "alibi_slopes"): None}


def _alibi_rows():
    """flash-attn's per-sequence slopes: the slope a per-row field (score_mod.ALIBI_ROW_SLOPES),
    bottom-right aligned."""
    tree = sm.alibi_tree(S, aligned=True, per_sequence=True)
    return tree, {sm.ALIBI_ROW_SLOPES: None, sm.Expr("node", (), ("dst", "_alibi_shift")): None}


MODS = {"softcap": _softcap, "alibi": _alibi, "piecewise": _piecewise, "window": _window,
        "nan_far": _nan_far, "nan_far_sqrt": _nan_far_sqrt}
#: trees run on one case and relation only (test_scalar_param_functions_emulated)
MORE_MODS = {"scalar_fns": _scalar_fns, "nan_capped": _nan_capped, "nan_shift_capped": _nan_shift_capped,
             "ceiling": _ceiling, "alibi_nan_inf": _alibi_nan_inf, "alibi_rows": _alibi_rows}


def _values(rng, tree, proto, nd, ns, H, dst, src):
    """the per-call values: numbers as given, arrays drawn here (int shift: each block's Lk - Lq)."""
    out = {}
    for x, v in proto.items():
        if v is not None:
            out[x] = v
        elif x.op == "head":
            out[x] = rng.uniform(0.05, 0.5, H)
        elif x == sm.ALIBI_ROW_SLOPES:   # positive, as ALiBi's: a value is at most its score, so the
            out[x] = rng.uniform(0.05, 0.5, (nd, H))   # zero rows past a block (stats 0) cannot overflow P
        elif x.attr == ("dst", "_alibi_shift"):
            per = (np.diff(src) - np.diff(dst)) - dst[:-1] + src[:-1]
            out[x] = np.repeat(per, np.diff(dst)).astype(np.float64)
        else:
            out[x] = rng.standard_normal((ns if x.attr[0] == "src" else nd, H))
    return out


def _pack(tree, values, H, nd, ns):
    """the kernels' packed values (cuda/score_codegen.pack, numpy arrays): mv, mnd, mns."""
    from tiga_numba.cuda.score_codegen import pack
    return pack(sm.BoundModifier(tree, values), np, np.float32, H, nd, ns, 0)[:3]


def oracle(tree, values, q, k, v, do, dst, src, causal, scale):
    """float64, the CPU's rule: y = min(f(z), 1e30); a cell whose f is NaN or at most -1e30 is
    masked (weight 0, no gradient), and a row whose every cell is masked is an empty row (output
    0, m = -inf); softmax over each block's (causal) cells, and the gradients with
    dS_z = P (dP - Delta) f'(z)."""
    nd, H, D = q.shape
    ns, Hkv, Dv = v.shape
    g = H // Hkv
    dtree = sm.diff(tree, S)
    out = np.zeros((nd, H, Dv))
    m = np.full((nd, H), -np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(len(causal)):
        i0, i1, j0, j1 = dst[b], dst[b + 1], src[b], src[b + 1]
        if i1 == i0 or j1 == j0:
            continue
        ii = np.arange(i0, i1, dtype=np.float64)[:, None]
        jj = np.arange(j0, j1, dtype=np.float64)[None, :]
        for h in range(H):
            qq, kk, vv = q[i0:i1, h].astype(np.float64), k[j0:j1, h // g].astype(np.float64), \
                v[j0:j1, h // g].astype(np.float64)
            z = qq @ kk.T * scale
            env = {S: z, DST: ii, SRC: jj}
            for x, val in values.items():
                if x.op == "scalar":
                    env[x] = np.float64(val)
                elif x.op == "head":
                    env[x] = np.float64(val[h])
                else:
                    a = np.asarray(val, np.float64)
                    a = a[:, h] if a.ndim == 2 else a
                    env[x] = a[i0:i1, None] if x.attr[0] == "dst" else a[None, j0:j1]
            with np.errstate(all="ignore"):
                f = np.broadcast_to(sm.evaluate(tree, env), z.shape)
                # f' = 0 where the clamp holds y constant (NaN / -inf: a masked cell; the ceiling)
                d = np.where((f > -1e30) & (f < 1e30), np.broadcast_to(sm.evaluate(dtree, env), z.shape), 0.0)
            keep = np.tril(np.ones(z.shape, bool)) if causal[b] else np.ones(z.shape, bool)
            keep &= f > -1e30   # NaN and -inf mask the edge
            y = np.where(keep, np.minimum(f, 1e30), -np.inf)
            mm = y.max(1)
            live = np.isfinite(mm)
            p = np.where(keep, np.exp(y - np.where(live, mm, 0.0)[:, None]), 0.0)
            p /= np.where(live, p.sum(1), 1.0)[:, None]
            o = p @ vv
            out[i0:i1, h], m[i0:i1, h] = o, mm
            dO = do[i0:i1, h].astype(np.float64)
            dv[j0:j1, h // g] += p.T @ dO
            ds = np.where(keep, p * (dO @ vv.T - (dO * o).sum(1)[:, None]) * d, 0.0)
            dq[i0:i1, h] = ds @ kk * scale
            dk[j0:j1, h // g] += ds.T @ qq * scale
    return out, m, dq, dk, dv


CASES = [  # (D, H, Hkv, dtype, forward shape, dq shape, dkdv shape)
    (64, 2, 1, "float16", dict(NW=4, MT=2, BN=64), dict(NW=4, BN=64), dict(NW=4, BN=64)),
    (64, 2, 2, "bfloat16", dict(NW=4, MT=1, BN=64), dict(NW=4, BN=32), dict(NW=4, BN=32)),
    (64, 2, 1, "float32", dict(NW=4, MT=1, BN=64, a_smem=True), dict(NW=4, BN=32, a_smem=True),
     dict(NW=4, BN=32, a_smem=True)),
    (64, 2, 1, "float16", dict(NW=4, BN=128, MT=1, a_smem=True, wgmma=True),
     dict(NW=4, BN=64, a_smem=True, wgmma=True, overlap=False), dict(NW=4, BN=64, a_smem=True, wgmma=True, overlap=False)),
    (64, 3, 3, "float32", dict(NW=4, BN=64, MT=1, a_smem=True, wgmma=True),
     dict(NW=4, BN=32, a_smem=True, wgmma=True, overlap=False), dict(NW=4, BN=32, a_smem=True, wgmma=True, overlap=False)),
]


@pytest.mark.parametrize("modname", list(MODS))
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("relname", ["dense_rect_tail", "causal_tail", "segments", "empty_keys"])
def test_modified_forward_backward_emulated(modname, case, relname, fold=True, ordered=False):
    D, H, Hkv, dtype, sf, sq, sk = CASES[case]
    dst, src, causal = (np.array(x) for x in RELATIONS[relname])
    nd, ns = int(dst[-1]), int(src[-1])
    rng = np.random.default_rng(hash((modname, case, relname)) % 2 ** 32)
    q, k, v, do = _inputs(rng, nd, ns, H, Hkv, D, dtype)
    tree, proto = {**MODS, **MORE_MODS}[modname]()
    values = _values(rng, tree, proto, nd, ns, H, dst, src)
    mod = Modifier(tree, TANH[dtype], fold)   # as the tensor-core api picks it
    fmod = Modifier(tree, TANH[dtype], fold, ordered) if ordered else mod   # the forward's
    assert (fmod.split is not None) == ordered
    packed = (mod,) + _pack(tree, values, H, nd, ns)
    scale = D ** -0.5
    ro, rm, rdq, rdk, rdv = oracle(tree, values, q, k, v, do, dst, src, causal, scale)
    vf = G.Variant("fwd", D, D, dtype=dtype, mod=fmod, **sf).check()
    st = {}
    o, m, l = E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), scale, stats=st, mod=packed)
    assert np.isfinite(o).all() and rel(o, ro) < TOL[dtype]
    live = np.isfinite(rm)
    # the kernels clamp y = f log2(e) at modifier.CEIL (base-2 units), the oracle f at 1e30
    np.testing.assert_allclose(m[live], np.minimum(rm[live], CEIL / G.LOG2E), rtol=1e-5, atol=1e-4)
    assert (m[~live] == -np.inf).all() and (l[~live] == 0).all() and (o[~live] == 0).all()
    mk = dict(MT=1)
    vq = G.Variant("dq", D, D, dtype=dtype, mod=mod, **mk, **sq).check()
    vk = G.Variant("dkdv", D, D, dtype=dtype, mod=mod, **mk, **sk).check()
    out = rounded(ro.astype(np.float32), dtype)
    grads = E.backward(vq, vk, do, q, k, v, out, m, l, dst, src, causal.astype(np.uint8), scale,
                       m_kernel=st["m_kernel"], mod=packed)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert np.isfinite(got).all(), name
        assert rel(got, want) < 3 * TOL[dtype], (name, rel(got, want))


@pytest.mark.parametrize("case", [2, 3])
def test_scalar_param_functions_emulated(case):
    test_modified_forward_backward_emulated("scalar_fns", case, "causal_tail")


@pytest.mark.parametrize("case", [0, 2, 3])
def test_per_sequence_alibi_slopes_emulated(case):
    """a per-row slope field (the slopes of each row's sequence) on rectangular segments: the
    distance's coefficient changes from row to row, so an ordered forward keeps the tree as
    written (no split)."""
    tree = _alibi_rows()[0]
    assert Modifier(tree, TANH[CASES[case][3]], True, True).split is None
    test_modified_forward_backward_emulated("alibi_rows", case, "segments")


@pytest.mark.parametrize("case", [0, 3])
def test_a_constant_derivative_is_zero_at_the_ceiling_emulated(case, monkeypatch):
    """f' = 1 (constant: cell() tests the ceiling only) is 0 on cells held at the ceiling. The dQ
    kernel's tail rows (zero queries past the block, stats (0, 0), never stored) reach the ceiling
    too, where P = 2^1e30 times f' = 0 is NaN: NaN operands are allowed in their products; the
    stored gradients are checked finite and right."""
    monkeypatch.setattr(E, "NAN_DATA", True)
    assert Modifier(_ceiling()[0], TANH[CASES[case][3]]).deriv_const
    test_modified_forward_backward_emulated("ceiling", case, "causal_tail")


@pytest.mark.parametrize("case", [0, 2, 3])
@pytest.mark.parametrize("ordered", [False, True])
def test_nan_and_infinite_values_in_the_split_forward_emulated(case, ordered, monkeypatch):
    """NaN and +inf values under ALiBi on a causal relation, with the distance split (the forward
    the API runs there) and without: NaN cells masked, +inf cells tied at the ceiling; the
    backward reads the split forward's m."""
    monkeypatch.setattr(E, "NAN_DATA", True)
    test_modified_forward_backward_emulated("alibi_nan_inf", case, "causal_tail", ordered=ordered)


@pytest.mark.parametrize("case", [0, 3])
@pytest.mark.parametrize("modname, fold", [("softcap", False), ("nan_capped", True), ("nan_shift_capped", True)])
def test_soft_cap_with_and_without_the_fold_emulated(modname, fold, case):
    """the 16-bit soft-cap kernels without the fold (a call whose soft-cap is too large for it) and
    the folded ones on NaN values (masked cells), mma.sync and wgmma: with an unbounded f' (its
    value tested) and with a bounded one (clamped)."""
    mod = Modifier({**MODS, **MORE_MODS}[modname]()[0], TANH[CASES[case][3]])
    assert mod.fold is not None
    assert (mod.deriv_bound is not None) == (modname != "nan_capped"), mod.deriv_bound
    test_modified_forward_backward_emulated(modname, case, "causal_tail", fold=fold)


def test_fold_takes_a_bounded_values_factor_only():
    """the fold (modifier.Fold): a 16-bit soft-cap's value c log2(e) tanh(z / c) is computed as
    tanh(z / c), the kernel's exponent scale set to c log2(e), one max.f32 for a clamp; what is not
    a bounded value times a host-checkable factor keeps the two-bound clamp and sc = 1."""
    from tiga_numba.cuda.tc import api
    from tiga_numba.cuda.tc.generator.modifier import FOLD_LIMIT
    tree, values = _softcap()
    hard = Modifier(tree, "hardware")
    assert hard.fold is not None and hard.fold.bound == 1.0
    assert "taken as the exponent scale" in hard.fold_words   # explain()'s words (the GPU tests look for them)
    holds = hard.fold.holds
    assert holds(values, 0.125) and holds({x: 0.5 for x in values}, 0.125)
    c = FOLD_LIMIT / G.LOG2E
    assert holds({x: 0.999 * c for x in values}, 1.0) and not holds({x: 1.001 * c for x in values}, 1.0)
    assert not holds({x: 2.0 ** -21 for x in values}, 1.0)   # K MASKED must stay a mask
    unfolded = Modifier(tree, "hardware", fold=False)
    for mod, folded in ((hard, True), (unfolded, False)):
        for kind in ("fwd", "dq", "dkdv"):
            text = G.gen_source(G.Variant(kind, 64, 64, dtype="float16", mod=mod, NW=4, MT=1, BN=64).check())
            # the forward's cells leave their values unclamped (softmax.guarded_softmax: maxima by
            # atleast's max.f32, a vote-guarded NaN fix, the two-bound clamp only on a warp's values
            # above the ceiling, not folded)
            assert ("atleast(" in text, "clampf(" in text, f"sc = {hard.fold.text}" in text) == (
                folded or kind == "fwd", not folded, folded), (kind, folded)
            assert ("any_sync(" in text) == (kind == "fwd")
    assert unfolded.fold is None and unfolded.digest != hard.digest and unfolded.fold_words == ""
    for other in (Modifier(tree, "exp2"), Modifier(_alibi()[0], "hardware"), Modifier(_scalar_fns()[0], "hardware"),
                  Modifier(sm.flash_tree(True, True, False), "hardware")):
        assert other.fold is None, other
    # a factor from a per-head param has no host value to check: not folded
    hc = sm.Expr("head", (), "cap")
    assert Modifier(sm.make("mul", hc, sm.make("tanh", S)), "hardware").fold is None
    # the api's choice per call: folded for softcap=30, the unfolded kernel for softcap=1e6
    from tiga_numba import functional
    q = np.zeros((4, 2, 8), np.float32)
    graph = tiga_numba.Graph.triangular(4)
    picks = [api._modifier_for(functional.flash_modifier(q, graph, cap, None), "float16", 8 ** -0.5)
             for cap in (30.0, 1e6, 30.0)]
    assert picks[0].fold is not None and picks[1].fold is None and picks[2] is picks[0]
    for cap in np.linspace(1.0, 2.0, api._FOLDS_KEPT + 5):   # a soft-cap changing every call: bounded memo
        assert api._modifier_for(functional.flash_modifier(q, graph, float(cap), None), "float16", 1.0) is picks[0]
    assert len(api._FOLDS) <= api._FOLDS_KEPT
    assert api._modifier_for(functional.flash_modifier(q, graph, 30.0, None), "float32", 1.0).fold is None

    class DeviceScalar:   # a scalar param held on the device: never read by the host to decide the fold
        def __float__(self):
            raise AssertionError("the fold's check read a device scalar")
    on_device = sm.BoundModifier(tree, {x: DeviceScalar() for x in values})
    assert api._modifier_for(on_device, "float16", 1.0).fold is None


def test_modifier_rules():
    """pruning, the fused backward and the overlapped wgmma backward refuse a modifier; the
    kernel name carries the tree's digest; per-edge fields are refused."""
    mod = Modifier(_softcap()[0])
    assert G.Variant("fwd", 64, 64, mod=mod).check().name().endswith(f"_m{mod.digest}")
    assert Modifier(_softcap()[0]) == mod and Modifier(_window()[0]).digest != mod.digest
    for bad in (dict(kind="fwd", prune=True, NW=4), dict(kind="dkdv", fuse_dq=True),
                dict(kind="dq", wgmma=True, a_smem=True, BN=64)):
        kind = bad.pop("kind")
        with pytest.raises(ValueError, match="score modifier"):
            G.Variant(kind, 64, 64, mod=mod, **bad).check()
    with pytest.raises(NotImplementedError, match="CSR"):
        Modifier(sm.make("add", S, sm.Expr("edge", (), "w")))



def test_lowering_hoists_what_no_cell_changes():
    """the per-cell text of soft-cap and ALiBi: no division, no scale or param product (hoisted
    into params()), tanh as the flavour says; the two flavours' kernels differ by name."""
    hard, exp2 = Modifier(_softcap()[0], "hardware"), Modifier(_softcap()[0], "exp2")
    for mod in (hard, exp2, Modifier(_alibi()[0])):
        cell = "\n".join(mod._lines)
        assert " / mks" not in cell and "msc" not in cell and "mks0 *" not in cell, cell
        assert any("msc" in line for line in mod._hoisted)
    assert sum("math.tanh" in x for x in hard._lines) == 1 and not any("ex2" in x for x in hard._lines)
    assert sum("ex2(" in x for x in exp2._lines) == 1 and sum("_dt(1.0) /" in x for x in exp2._lines) == 1
    assert not any("tanh" in x for x in exp2._lines)
    assert hard != exp2 and hard.digest != exp2.digest
    # ALiBi's dst.index + shift depends on the row only: its load is staged, never per cell
    alibi = Modifier(_alibi()[0])
    assert not any("ldg_f32_if" in x for x in alibi._lines)
    assert any("ldg_f32_if" in x for x in alibi._stages["dst"][0]) and not alibi._stages["src"][0]
    with pytest.raises(ValueError, match="tanh"):
        Modifier(_softcap()[0], "fast")


def test_flash_modifier_values_are_packed_once_not_copied_per_call():
    """softcap= and alibi_slopes= values in cuda/score_codegen.pack's layout (scalars, then the
    per-head slopes; the bottom-right shift as a dst field broadcast over heads), with the host
    numbers and the shift made once and reused by later calls: a per-call host-to-device copy
    from pageable memory would make the host wait for the stream on every call."""
    import tiga_numba as tg
    from tiga_numba import functional
    from tiga_numba.cuda import score_codegen as mods
    rng = np.random.default_rng(7)
    H, nd, ns = 2, 6, 9
    q = rng.standard_normal((nd, H, 8)).astype(np.float32)
    slopes = rng.uniform(0.1, 0.9, H).astype(np.float32)
    graph = tg.Graph.dense(ns, nd)   # rectangular: ALiBi's bottom-right shift is Lk - Lq = 3
    both = [functional.flash_modifier(q, graph, 3.0, slopes) for _ in range(2)]
    shift = sm.Expr("node", (), ("dst", "_alibi_shift"))
    assert both[0].values[shift] is both[1].values[shift]   # cached on the graph
    assert both[0].values[shift].tolist() == [ns - nd] * nd
    mv, mnd, mns, mef = mods.pack(both[0], np, np.float32, H, nd, ns, 0)
    np.testing.assert_array_equal(mv, np.array([3.0, *slopes], np.float32))
    np.testing.assert_array_equal(mnd, np.full(nd * H, ns - nd, np.float32))
    assert mns.size == 1 and mef.size == 1 and mns is mef   # one shared stand-in
    capped = [mods.pack(functional.flash_modifier(q, graph, c, None), np, np.float32, H, nd, ns, 0)[0]
              for c in (3.0, 3.0, 2.5)]
    assert capped[0] is capped[1] and capped[0].tolist() == [3.0] and capped[2].tolist() == [2.5]


def test_prebuild_names_the_kernels_a_flash_modifier_call_launches():
    """`prebuild --modifiers` builds the Variants a softcap= / alibi_slopes= call runs: the same
    tree as functional.flash_modifier (plain ALiBi on triangular relations, bottom-right aligned on
    rectangular cu_seqlens), the dtype's tanh, the two-kernel backward without overlap."""
    import tiga_numba as tg
    from tiga_numba import functional
    from tiga_numba.cuda.tc import build, tuning
    q = np.zeros((6, 2, 8), np.float32)
    slopes = np.ones(2, np.float32)
    for graph, name in ((tg.Graph.triangular(6), "softcap+alibi"),
                        (tg.Graph.cu_seqlens([0, 2, 6], cu_seqlens_k=[0, 3, 9]), "softcap+alibi-aligned")):
        assert functional.flash_modifier(q, graph, 3.0, slopes).tree == sm.flash_tree(*sm.FLASH_TREES[name])
    assert functional.flash_modifier(q, tg.Graph.triangular(6), 3.0, None).tree == _softcap()[0]
    specs = build.modified_kernels(["softcap", "alibi-aligned"], ("float16", "float32"))
    assert ("wg:dq", 128, "float16", None, "softcap") in specs and ("fwd", 64, "float32", None, "alibi-aligned") in specs
    v = build.modified_variant("wg:dkdv", 128, "float16", "softcap")
    want = tuning.with_modifier(tuning.variant("dkdv", 128, 128, "float16", wgmma=True),
                                Modifier(_softcap()[0], TANH["float16"]))
    assert v == want and v.mod.tanh == "hardware" and not v.overlap and not v.fuse_dq
    assert build.modified_variant("fwd", 64, "float32", "softcap").mod.tanh == "exp2"
    # explain() names the tanh that ran; none without a tanh
    assert "tanh.approx.f32" in v.mod.tanh_words
    assert "ex2 / rcp" in build.modified_variant("fwd", 64, "float32", "softcap").mod.tanh_words
    assert build.modified_variant("wg:fwd", 64, "float16", "alibi").mod.tanh_words == ""
    with pytest.raises(ValueError, match="unknown modifier"):
        build.modified_kernels(["tanh"])
    # ALiBi on an ordered relation (triangular here) runs the split forward: prebuilt too
    ordered = build.modified_variant("wg:fwd", 128, "float16", "alibi" + build.ORDERED_SUFFIX)
    assert ordered.mod.split is not None
    assert ("wg:fwd", 128, "float16", None, "alibi" + build.ORDERED_SUFFIX) in build.modified_kernels(["alibi"])
    specs = build.modified_kernels(["alibi"])
    assert ("wg:fwd", 64, "bfloat16", None, "alibi" + build.ORDERED_SUFFIX) in specs
    assert not any(s[0].endswith(("dq", "dkdv")) and s[4].endswith(build.ORDERED_SUFFIX) for s in specs)
    assert not any(s[4].endswith(build.ORDERED_SUFFIX) for s in build.modified_kernels(["softcap"]))
    from tiga_numba.cuda.tc import api
    bound = functional.flash_modifier(q, tg.Graph.triangular(6), None, slopes)
    rec = api._host_record(tg.Graph.triangular(6)._blocks)
    gmod = api._modifier_for(bound, "float16", 0.125)
    assert api._ordered_modifier(bound, rec, gmod) == ordered.mod
    assert api._ordered_modifier(bound, api._host_record(tg.Graph.dense(6)._blocks), gmod) is gmod


def test_registry_routes_modifiers():
    """a per-head param that wants its gradient: the registry refuses the tensor cores by name."""
    from tiga_numba import registry
    req = registry.Request(op="backward", backend="cuda", relation_kind="triangular", implicit=True,
                           score="modified: f = ...", modified=True, modifier_grads=True, dtype="float16",
                           head_dim=64, value_dim=64, heads=2, kv_heads=2)
    why = registry._tensor_cores(req)
    assert why is not None and "CUDA cores" in why
    for change, words in ((dict(modifier_grads=False, pruned=True, op="forward"), "pruning"),
                          (dict(modifier_grads=False, score="modified: f = x (no dot product: gather only)"), "gathers")):
        assert words in registry._tensor_cores(dataclasses.replace(req, **change))
    # without grads, pruning or gathers a modifier reaches the device probe (none here: no GPU)
    assert "no tensor-core kernels" in registry._tensor_cores(dataclasses.replace(req, modifier_grads=False))


#: relations whose every edge keeps its source at or before the destination's position (ALiBi's
#: distance taken signed and split: modifier.Split), and ones that do not
ORDERED_GRAPHS = {
    "causal": lambda tg: tg.Graph.triangular(131),
    "window": lambda tg: tg.Graph.band(150, left=40),
    "rect_causal": lambda tg: tg.Graph.cu_seqlens([0, 30, 100, 101], cu_seqlens_k=[0, 50, 90, 97]),
    "varlen_window": lambda tg: tg.Graph.cu_seqlens([0, 1, 70, 200], window=(33, 0)),
    # decode: the rows' positions near 6000, where float32 holds a distance term c j to ~2^-11
    # (the split's terms are relative to each key block's first column: fp32-class here too).
    # The last 600 keys only (a window): the large positions are the point, and each key block
    # costs the emulator about as much as a whole small relation
    "decode": lambda tg: tg.Graph.cu_seqlens([0, 3], cu_seqlens_k=[0, 6000], window=(600, 0)),
}
UNORDERED_GRAPHS = {
    "dense": lambda tg: tg.Graph.dense(40, 50),
    "two_sided": lambda tg: tg.Graph.band(130, left=20, right=7),
    "segments_full": lambda tg: tg.Graph.cu_seqlens([0, 30, 64], causal=False),
}
#: (case of CASES, or its dtype's shipped D = 128 wgmma kernels): mma.sync, wgmma, the pipelined
#: ping-pong wgmma forward
ORDERED_CASES = [(0, False), (1, False), (2, False), (3, False), (3, True), (4, False)]


def _flash_call(tg, graph, dtype, D, H, Hkv, softcap, seed):
    from tiga_numba import functional
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, graph.num_dst, graph.num_src, H, Hkv, D, dtype)
    slopes = rng.uniform(0.05, 0.9, H)   # up to ALiBi's largest slope and beyond
    return (q, k, v, do, slopes), functional.flash_modifier(q, graph, softcap, slopes)


@pytest.mark.parametrize("graphname", list(ORDERED_GRAPHS))
@pytest.mark.parametrize("case,shipped", ORDERED_CASES)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_ordered_alibi_splits_the_forward_emulated(graphname, case, shipped, softcap):
    """ALiBi on a relation whose sources never pass the destination's (bottom-right aligned)
    position: the forward takes the distance signed and split into a column term and a row offset
    per key block (modifier.Split); out, m and the backward that reads its m (the values as
    written) match the float64 CPU call; the API's check finds the order."""
    if graphname == "decode" and softcap is not None:
        pytest.skip("the long rows once per kernel shape (the soft-cap adds nothing there)")
    import tiga_numba as tg
    from tiga_numba.cuda.tc import api, tuning
    D, H, Hkv, dtype, sf, sq, sk = CASES[case]
    if shipped:   # the shipped D = 128 16-bit wgmma kernels: the pipelined ping-pong forward
        D = 128
    graph = ORDERED_GRAPHS[graphname](tg)
    (q, k, v, do, slopes), bound = _flash_call(tg, graph, dtype, D, H, Hkv, softcap,
                                               hash((graphname, case, shipped, softcap)) % 2 ** 32)
    rec = api._host_record(graph._blocks)
    mod0 = Modifier(bound.tree, TANH[dtype], fold=True)
    assert api.ordered(rec, bound, mod0.distances)
    mod = Modifier(bound.tree, TANH[dtype], fold=True, ordered=True)
    assert mod.split is not None and mod.digest != mod0.digest
    if shipped:
        vf = tuning.with_modifier(tuning.variant("fwd", D, D, dtype, wgmma=True), mod)
        assert vf.fwd_pipelined
    else:
        vf = G.Variant("fwd", D, D, dtype=dtype, mod=mod, **sf).check()
    nd, ns = graph.num_dst, graph.num_src
    dst, src, causal = (np.asarray(x) for x in (graph._blocks.dst_offsets, graph._blocks.src_offsets,
                                                graph._blocks.causal))
    lo, hi = np.asarray(graph._blocks.lo), np.asarray(graph._blocks.hi)
    packed = (mod,) + _pack(bound.tree, bound.values, H, nd, ns)
    scale = D ** -0.5
    st = {}
    o, m, l = E.forward(vf, q, k, v, dst, src, causal.astype(np.uint8), scale, stats=st, mod=packed, lo=lo, hi=hi)
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    ro, rstats = tg.attention(*f64[:3], graph, scale=scale, softcap=softcap, alibi_slopes=slopes, return_stats=True)
    rm = np.asarray(rstats.m)
    assert np.isfinite(o).all() and rel(o, ro) < TOL[dtype], rel(o, ro)
    live = np.isfinite(rm)
    np.testing.assert_allclose(m[live], rm[live], rtol=1e-5, atol=1e-4)
    assert (m[~live] == -np.inf).all() and (l[~live] == 0).all() and (o[~live] == 0).all()
    # the backward recomputes the values as written, from the split forward's base-2 m
    packed0 = (mod0,) + packed[1:]
    if shipped:
        vq, vk = (tuning.with_modifier(tuning.variant(kind, D, D, dtype, wgmma=True), mod0) for kind in ("dq", "dkdv"))
    else:
        vq = G.Variant("dq", D, D, dtype=dtype, mod=mod0, MT=1, **sq).check()
        vk = G.Variant("dkdv", D, D, dtype=dtype, mod=mod0, MT=1, **sk).check()
    for vb in (vq, vk):
        with pytest.raises(ValueError, match="the backward kernels take the modifier without"):
            dataclasses.replace(vb, mod=mod).check()
    out = rounded(np.asarray(ro, np.float32), dtype)
    grads = E.backward(vq, vk, do, q, k, v, out, m, l, dst, src, causal.astype(np.uint8), scale,
                       m_kernel=st["m_kernel"], mod=packed0, lo=lo, hi=hi)
    want = tg.attention_backward(f64[3], *f64[:3], ro, rstats, graph, scale=scale, softcap=softcap,
                                 alibi_slopes=slopes)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert np.isfinite(got).all(), name
        assert rel(got, w) < 3 * TOL[dtype], (name, rel(got, w))


def test_the_order_check_refuses_what_it_cannot_prove():
    """api.ordered: relations with an edge past the destination's position, and a shift field
    that moves a row's position before its last source, keep |.| (the unsplit forward); the
    check is memoised per relation for the same field arrays, and a new array is checked anew."""
    import tiga_numba as tg
    from tiga_numba import functional
    from tiga_numba.cuda.tc import api
    for name, make in UNORDERED_GRAPHS.items():
        graph = make(tg)
        _, bound = _flash_call(tg, graph, "float16", 64, 2, 1, None, 0)
        rec = api._host_record(graph._blocks)
        assert not api.ordered(rec, bound, Modifier(bound.tree).distances), name
    graph = ORDERED_GRAPHS["rect_causal"](tg)
    q = np.zeros((graph.num_dst, 2, 8), np.float32)
    rec = api._host_record(graph._blocks)
    shift = functional._alibi_shift(graph)
    good = functional.flash_modifier(q, graph, None, np.ones(2))
    dist = Modifier(good.tree).distances
    assert len(dist) == 1 and api.ordered(rec, good, dist)
    for bad_row in (0, 29, 99):   # one row's position one before its last source
        moved = shift.copy()
        moved[bad_row] -= 1
        bad = sm.bind_flash(None, np.ones(2), moved)
        assert bad.tree == good.tree and not api.ordered(rec, bad, dist), bad_row
    assert api.ordered(rec, good, dist)   # the good array again: checked anew, still ordered
    # a user's node field in P: never split (the host would read it every call; it may change in place)
    user = sm.make("sub", S, sm.Expr("abs", (sm.make("sub", sm.make("add", DST, sm.Expr("node", (), ("dst", "f"))),
                                                     SRC),)))
    assert Modifier(user).distances == () and Modifier(user, ordered=True).split is None
    # positions past 2^24 (inexact in float32): not split
    big = sm.Expr("node", (), ("dst", "_alibi_shift"))
    far = sm.bind_flash(None, np.ones(2), shift + 2 ** 24)
    assert far.tree == good.tree and Modifier(far.tree).distances == dist and not api.ordered(rec, far, dist)
    assert big in sm.leaves(dist[0])
    # a tree without a distance is never split, ordered or not
    cap = Modifier(_softcap()[0], ordered=True)
    assert cap.split is None and cap.digest == Modifier(_softcap()[0]).digest
