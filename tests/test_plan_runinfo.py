"""Plan.run_info (plan.RunInfo): a pruned forward's tile counts are deferred device reads, fetched
once on first access, and every way of reading the dict sees the fetched values."""
from tiga_numba.plan import RunInfo, defer_counts


def test_deferred_counts_are_fetched_once_on_first_read():
    calls = []
    info = RunInfo(kernel="k")
    defer_counts(info, lambda: calls.append(1) or (3, 10))
    assert calls == []                                    # the call itself reads nothing
    assert info["pruned_tiles"] == 3 and info.get("total_tiles") == 10
    assert dict(info) == {"kernel": "k", "pruned_tiles": 3, "total_tiles": 10}
    assert info.copy() == dict(info) and dict(info.items()) == dict(info)
    assert calls == [1]


def test_every_reader_resolves_and_plain_dicts_are_filled_at_once():
    for read in (dict, lambda i: i.copy(), lambda i: list(i.values()), lambda i: {k: i[k] for k in i},
                 lambda i: i.get("total_tiles"), repr):
        info = RunInfo()
        defer_counts(info, lambda: (1, 2))
        read(info)
        assert dict.__getitem__(info, "pruned_tiles") == 1 and dict.__getitem__(info, "total_tiles") == 2
    plain = {}
    defer_counts(plain, lambda: (5, 6))
    assert plain == {"pruned_tiles": 5, "total_tiles": 6}


def test_a_plan_says_what_its_own_call_did_after_later_calls():
    """explain() reads the plan record: the cache word and totals of a finished call are fixed
    when it ends (a later call must not change them); a plan made without running says that
    nothing was copied yet rather than "none"."""
    import numpy as np
    import tiga_numba as tg
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((12, 2, 4)).astype(np.float32) for _ in range(3))
    _, st = tg.attention(q, k, v, tg.Graph.triangular(12), return_stats=True)
    before = st.plan.explain()
    tg.attention(q, k, v, tg.Graph.dense(12))
    tg.attention(q, k, v, tg.Graph.triangular(12))
    assert st.plan.explain() == before
    plan = tg.make_plan(q, k, v, tg.Graph.triangular(12))
    assert "copies: (not run yet)" in plan.explain()
    pruned = tg.make_plan(q, k, v, tg.Graph.dense(12), block_prune_threshold=0.5).explain()
    assert "tile pruning: APPROXIMATE, rho=0.5; last call: not run yet" in pruned


def test_explain_after_a_call_that_raised_says_so():
    """A call that raises makes no plan: tg.explain() names it and its error first, then gives
    the last completed call's plan (never passes that one off as the most recent); last_plan()
    stays the completed call's; the next call that completes clears it. Programs the same, in
    their own explain() and in tg.explain(), for a call, a vjp and a vjp(dout)."""
    import numpy as np
    import pytest
    import tiga_numba as tg
    from tiga_numba import functional
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((12, 2, 4)).astype(np.float32) for _ in range(3))
    g = tg.Graph.triangular(12)
    tg.attention(q, k, v, g)
    done = functional.last_plan()
    with pytest.raises(ValueError):
        tg.attention(q[:5], k, v, g)
    text = tg.explain()
    assert text.startswith("the most recent call failed: tiga_numba.attention raised ValueError: q has 5 rows")
    assert "the last call that completed:\n" + done.explain() in text
    assert functional.last_plan() is done
    with pytest.raises(TypeError):
        tg.attention_backward(q, q, k, v, q, done, g)   # stats: a plan, not the forward's stats
    assert tg.explain().startswith("the most recent call failed: tiga_numba.attention_backward raised")
    tg.attention(q, k, v, g)
    assert not tg.explain().startswith("the most recent call failed")

    class Attend(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, scale):
            return self.reducer((src.key * dst.query).sum(-1) * scale, src.value)

    prog = Attend()
    fields = dict(graph=g, src={"key": k, "value": v}, scale=0.5)
    with pytest.raises(ValueError):
        prog(dst={"query": q[:3]}, **fields)
    assert prog.explain().startswith("Attend (tiga_numba.MessagePassing program): not called yet (no "
                                     "call has completed; the most recent one failed: Attend(...) raised ValueError")
    assert tg.explain().startswith("the most recent call failed: Attend(...) raised ValueError: dst['query']")
    out, vjp = prog.vjp(dst={"query": q}, **fields)
    with pytest.raises(ValueError):
        vjp(out[:3])
    text = prog.explain()
    assert text.startswith("the most recent call failed (the vjp(dout) of Attend.vjp raised ValueError")
    assert "program: Attend (tiga_numba.MessagePassing)" in text
    vjp(out)
    assert prog.explain().startswith("program: Attend")
    assert not tg.explain().startswith("the most recent call failed")
    # a failed call does not rewrite what the completed one did: it traced edge() (a new
    # signature), the failing call with that signature reused the trace and failed after
    fresh = Attend()
    fresh(dst={"query": q}, **fields)
    with pytest.raises(TypeError):
        fresh(dst={"query": q}, **dict(fields, scale="x"))
    assert "last call traced edge()" in fresh.explain()
    fresh(dst={"query": q}, **fields)
    assert "last call reused a trace" in fresh.explain()
    # a GNN layer's failure is the most recent call too, until a call completes
    from tiga_numba.layers import GATConv
    conv = GATConv(4, 3, heads=2)
    with pytest.raises(ValueError):
        conv(q[:5, 0], g)
    assert tg.explain().startswith("the most recent call failed: GATConv(...) raised ValueError")
    out, lvjp = conv.vjp(q[:, 0], g)
    assert not tg.explain().startswith("the most recent call failed")
    with pytest.raises(ValueError):
        lvjp(out[:3])
    assert tg.explain().startswith("the most recent call failed: the vjp(dout) of GATConv.vjp raised")


def test_repeated_calls_reuse_validation_and_plan_but_not_their_record():
    """A call with the same graph, array types, shapes, dtypes, scale, threshold, score and options
    as one that passed validation reuses its checked facts and plan (functional's call memo): the
    results equal a fresh graph's, each call gets its own plan and run_info, and whatever differs
    from a remembered call (the scale's type, a dtype, a shape, the options) is validated again."""
    import numpy as np
    import pytest
    import tiga_numba as tg
    from tiga_numba import functional
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((9, 2, 8)).astype(np.float32) for _ in range(3))
    g = tg.Graph.band(9, left=3)
    first, st1 = tg.attention(q, k, v, g, scale=1, return_stats=True)
    plan1 = functional.last_plan()
    again, st2 = tg.attention(q, k, v, g, scale=1, return_stats=True)
    plan2 = functional.last_plan()
    assert plan2 is not plan1 and plan2.run_info is not plan1.run_info
    assert st1.plan is plan1 and st2.plan is plan2

    def said(plan):   # where the kernel came from aside, the two calls did the same
        return [line for line in plan.explain().splitlines() if not line.startswith("kernel cache:")]
    assert said(plan2) == said(plan1) and "kernel cache: this call memory hit" in plan2.explain()
    fresh = tg.attention(q, k, v, tg.Graph.band(9, left=3), scale=1)
    np.testing.assert_array_equal(first, fresh)
    np.testing.assert_array_equal(again, fresh)
    memo = g._cached(("validated calls",), dict)
    assert len(memo) == 1
    with pytest.raises(TypeError, match="scale must be a real number"):
        tg.attention(q, k, v, g, scale=True)          # equal to 1 as a key, but a bool
    with pytest.raises(TypeError, match="dtype"):
        tg.attention(q, k.astype(np.float64), v, g, scale=1)
    with pytest.raises(ValueError, match="rows"):
        tg.attention(q[:4], k, v, g, scale=1)
    out = tg.attention(q, k, v, g, scale=np.array(0.5))   # a 0-d array: no key, validated each call
    np.testing.assert_allclose(out, tg.attention(q, k, v, g, scale=0.5), rtol=1e-6)
    other = "blas" if plan1.options.cpu_products != "blas" else "own"
    with tg.options(cpu_products=other):
        tg.attention(q, k, v, g, scale=1)
        assert functional.last_plan().options.cpu_products == other
    tg.attention(q, k, v, g, scale=1)
    assert functional.last_plan().options == plan1.options
    dq, dk, dv = tg.attention_backward(q, q, k, v, first, st1, g, scale=1)
    dq2, dk2, dv2 = tg.attention_backward(q, q, k, v, again, st2, g, scale=1)
    for a, b in ((dq, dq2), (dk, dk2), (dv, dv2)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="dout"):
        tg.attention_backward(q[:, :1], q, k, v, again, st2, g, scale=1)
    for s in np.linspace(0.1, 2.0, 2 * functional._CALL_MEMO_SIZE):
        tg.attention(q, k, v, g, scale=float(s))
    assert len(memo) <= functional._CALL_MEMO_SIZE
