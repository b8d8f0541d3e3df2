"""Score modifiers in the CUDA-core kernels, run in numba's CUDA simulator (no GPU needed).

Each case runs in a subprocess with NUMBA_ENABLE_CUDASIM=1 (as tests/test_cuda_sim.py, whose
launch functions these cases reuse): the modifier is traced by the program API into its tree and
bound values, compiled into the block / CSR kernels (cuda/score_codegen.py), and the forward
and every gradient (dq, dk, dv, per-head params, dst / src fields, edge fields) are compared
with the float64 oracle of tests/test_score_mods.py. Shapes stay small (odd sizes, an empty
row, a hub row and a hub source, GQA) so a case runs in seconds. Rows whose every edge the
modifier masks (-inf) are empty rows, as on the CPU: output 0, l = 0, no gradient.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))

SIM_CASES = ["blocks_segments_full_f64", "blocks_band_flash_f32", "blocks_gat_no_dot",
             "blocks_lane_groups_full", "csr_full_f64", "csr_split_edge_fields", "csr_gat_no_dot",
             "blocks_masked_rows_f32", "csr_split_masked_rows"]


def _have_numba_cuda():
    import importlib.util
    return importlib.util.find_spec("numba_cuda") is not None


@pytest.mark.skipif(not _have_numba_cuda(), reason="numba-cuda is not installed")
@pytest.mark.parametrize("case", SIM_CASES)
def test_simulated_modifier_kernels(case):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), case], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


class SimModifier:
    """A bound modifier's launch state, as cuda/api.py builds it: packed values, row-owned
    gradient buffers of the two backward passes, per-piece partials of split CSR rows and
    the edge-field gradients (host arrays: the simulator passes arrays, not pointers)."""

    def __init__(self, bound, acc, H, Nq, Nk, E):
        from tiga_numba.cuda import score_codegen as mods
        self.mods, self.bound, self.acc = mods, bound, np.dtype(acc)
        self.H, self.Nq, self.Nk, self.E = H, Nq, Nk, E
        self.gen = mods.generated(bound.tree, bound.grad_leaves, self.acc.name)
        self.vals = mods.pack(bound, np, self.acc, H, Nq, Nk, E)
        _, self.rows_q, self.edges_q = self.gen.grad(("head", "dst", "edge"))
        _, self.rows_k, _ = self.gen.grad(("src",))
        self.mgq = np.zeros((Nq, len(self.rows_q), H), self.acc) if self.rows_q else None
        self.mgk = np.zeros((Nk, len(self.rows_k), H), self.acc) if self.rows_k else None
        self.mge = np.zeros((E, len(self.edges_q), H), self.acc) if self.edges_q else None
        self.mpq = self.mpk = None

    def _z(self):
        return np.zeros(2, self.acc)

    def _flat(self, a):
        return self._z() if a is None else a.reshape(-1)

    def forward_args(self):
        return self.vals + (self._z(), self._z(), self._z())

    def dst_args(self, n_slots=None):
        if n_slots is not None and self.mgq is not None:
            self.mpq = np.full((n_slots, self.mgq.shape[1], self.H), np.nan, self.acc)
        return self.vals + (self._flat(self.mgq), self._flat(self.mpq), self._flat(self.mge))

    def src_args(self, n_slots=None):
        if n_slots is not None and self.mgk is not None:
            self.mpk = np.full((n_slots, self.mgk.shape[1], self.H), np.nan, self.acc)
        return self.vals + (self._flat(self.mgk), self._flat(self.mpk), self._z())

    def merge(self, qsplits, ksplits):
        """Split rows: their pieces' sums added in slot order (make_sum_merge, as api.py)."""
        from tiga_numba.cuda import csr
        for part, sp, dst in ((self.mpq, qsplits, self.mgq), (self.mpk, ksplits, self.mgk)):
            if part is None:
                continue
            W = dst.shape[1] * self.H
            mk = csr.make_sum_merge(self.acc.name, self.acc.name, W)
            mk((sp.shape[0], 1, 1), (mk.NT, 1, 1), None, part.reshape(-1), sp.reshape(-1),
               dst.reshape(-1), sp.shape[0], 1, self.acc.type(1.0))

    def grads(self):
        return self.mods.unpack(self.bound, self.gen, np, self.acc, self.H, self.Nq, self.Nk,
                                self.E, dst_rows=self.mgq, src_rows=self.mgk, edges=self.mge)


# --------------------------------------------------------------------------- one case
def run_case(fn, graph, dtype, tol, H=4, Hkv=2, D=5, DV=3, dot=True, params=None,
             node_heads=(False, True), edge_fields=(), piece=None, lanes=None):
    import test_cuda_sim as ts
    import test_score_mods as tsm
    from tiga_numba import score_mod as sm
    rng = np.random.default_rng(11)
    params = dict(params or {})
    n_dst, n_src = graph.num_dst, graph.num_src
    src, dst, edge = {}, {}, {}
    if dot:
        dst["query"] = rng.standard_normal((n_dst, H, D))
        src["key"] = rng.standard_normal((n_src, Hkv, D))
    src["value"] = rng.standard_normal((n_src, Hkv if dot else H, DV))
    if "a" in fn.__code__.co_names:
        dst["a"] = rng.standard_normal((n_dst, H) if node_heads[1] else (n_dst,))
        src["a"] = rng.standard_normal((n_src, H) if node_heads[0] else (n_src,))
    for name in edge_fields:
        edge[name] = rng.standard_normal((graph.num_edges, H) if name == "b" else graph.num_edges)
    cast = {r: {n: a.astype(dtype) for n, a in d.items()} for r, d in
            (("src", src), ("dst", dst), ("edge", edge))}
    # lowered for a vjp: float scalar leaves are read per head, whose gradients give theirs
    low = tsm.ModProgram(fn, dot)._lower(graph, cast["src"], cast["dst"], cast["edge"],
                                         dict(params, scale=0.4), for_grad=True)
    bound = low.modifier
    q, k, v = low.q, low.k, low.value
    scale = float(low.scale)
    acc = "float64" if dtype == np.float64 else "float32"
    E = graph.num_edges
    mod = SimModifier(bound, acc, q.shape[1], n_dst, n_src, E if not graph.is_implicit else 0)
    dout = rng.standard_normal((n_dst, q.shape[1], DV))
    want, wg = tsm.oracle(fn, graph, dst.get("query"), src.get("key"), src["value"], dout, 0.4,
                          {n: a for n, a in src.items() if n not in ("key", "value")},
                          {n: a for n, a in dst.items() if n != "query"}, edge,
                          {n: np.asarray(x, np.float64) if isinstance(x, np.ndarray) else x
                           for n, x in params.items()}, dot=dot)
    rel = graph.realize("cpu")
    if graph.is_implicit:
        r5 = (np.asarray(rel.dst_offsets), np.asarray(rel.src_offsets), np.asarray(rel.causal),
              np.asarray(rel.lo), np.asarray(rel.hi))
        t = None
        if lanes is not None:
            t = ts.tiles(np.dtype(dtype).name, q.shape[2], DV, R=2, NT=16, BN=8, G=4, VEC=4)
        out, m, l, _ = ts.blocks_forward(q, k, v, r5, scale, np.dtype(dtype).name, t=t, mod=mod)
        # a fresh gradient state (the forward wrote none)
        mod = SimModifier(bound, acc, q.shape[1], n_dst, n_src, 0)
        dq, dk, dv, _ = ts.blocks_backward(dout.astype(dtype), q, k, v, out, m, l, r5, scale,
                                           np.dtype(dtype).name, lanes=lanes, mod=mod)
    else:
        tr = graph.realize_transpose("cpu")
        out, m, l = ts.csr_forward(q, k, v, rel.indptr, rel.indices, None, scale,
                                   np.dtype(dtype).name, piece=piece, mod=mod)
        dq, dk, dv, _ = ts.csr_backward(dout.astype(dtype), q, k, v, out, m, l, rel.indptr,
                                        rel.indices, tr.indptr, tr.indices, tr.perm, None, scale,
                                        np.dtype(dtype).name, piece=piece, mod=mod)
    tag = f"{fn.__name__} {graph.kind} {np.dtype(dtype).name}"
    assert not np.isnan(out).any(), tag + ": NaN in out"
    tsm._close(out, want, tol, tag + " out")
    fin = np.isfinite(m)
    assert (l[~fin] == 0).all(), tag + ": an empty row must have l = 0"
    if fn is _masked_rows:   # the masked rows are empty rows: l = 0 (not a uniform softmax)
        assert (l[[0, 1, 5]] == 0).all() and (out[[0, 1, 5]] == 0).all(), tag + ": a masked row is not empty"
    got = {"src": {"value": dv}, "dst": {}, "edge": {}, "params": {}}
    if dot:
        got["dst"]["query"] = dq
        got["src"]["key"] = dk
    scalar_grads = []   # as the program's backward: (scalar expression, its gradient)
    if dot:
        scalar_grads.append((low.factor, float((q.astype(np.float64) * dq).sum()) / scale))
    for leaf, g in mod.grads().items():
        if leaf in low.lowered_scalars:
            scalar_grads.append((low.lowered_scalars[leaf], float(np.sum(g, dtype=np.float64))))
        elif leaf.op == "head":
            got["params"][leaf.attr] = g
        elif leaf.op == "node":
            got[leaf.attr[0]][leaf.attr[1]] = g
        else:
            got["edge"][leaf.attr] = g
    low._chain_scalar_grads(got, scalar_grads, np.dtype(acc))
    for role in ("src", "dst", "edge", "params"):
        for n, w in wg[role].items():
            assert n in got[role], (tag, role, n, sorted(got[role]))
            tsm._close(got[role][n], w, tol, f"{tag} {role}.{n}")
    print(f"ok {tag}: out and {sum(len(x) for x in wg.values())} gradients")
    assert isinstance(bound.tree, sm.Expr)


def _csr_graph():
    """11 destinations x 9 sources: an empty row (3), a hub row (5, every source), a hub
    source (2, every row but the empty one)."""
    import scipy.sparse as sps
    import tiga_numba as tg
    rng = np.random.default_rng(3)
    mask = rng.random((11, 9)) < 0.3
    mask[:, 2] = True
    mask[5] = True
    mask[3] = False
    return tg.Graph.from_scipy(sps.csr_matrix(mask.astype(np.float64)))


def _masked_rows(s, src, dst, edge, p):
    """rows 0, 1 and 5 (the CSR graph's hub row, split into pieces) masked by their scores alone"""
    capped = 1.5 * np.tanh(s / 1.5)
    return np.where(dst.index < 2, -np.inf, np.where(dst.index == 5, -np.inf, capped))


def _cases():
    import tiga_numba as tg
    import test_score_mods as tsm
    rng = np.random.default_rng(5)
    full = dict(c=2.5, slopes=rng.uniform(0.2, 1.0, 4))
    segs = tg.Graph.cu_seqlens(np.array([0, 5, 5, 12, 13]), causal=True)

    def flash(s, src, dst, edge, p):
        return 1.5 * np.tanh(s / 1.5) - p["slopes"] * np.abs(dst.index - src.index)

    return {
        "blocks_segments_full_f64": lambda: run_case(tsm._full_mod, segs, np.float64, 1e-6,
                                                     params=full),
        "blocks_band_flash_f32": lambda: run_case(flash, tg.Graph.band(13, left=4, right=1),
                                                  np.float32, 2e-4,
                                                  params={"slopes": rng.uniform(0.1, 0.6, 4)}),
        "blocks_gat_no_dot": lambda: run_case(tsm._gat_mod, tg.Graph.dense(9, 7), np.float64,
                                              1e-6, dot=False, node_heads=(True, True), H=2),
        "blocks_lane_groups_full": lambda: run_case(
            tsm._full_mod, tg.Graph.cu_seqlens(np.array([0, 5, 13]), causal=False,
                                               cu_seqlens_k=np.array([0, 7, 17])),
            np.float32, 2e-4, D=16, DV=12, params=full, lanes=(4, 4)),
        "csr_full_f64": lambda: run_case(tsm._full_mod, _csr_graph(), np.float64, 1e-6,
                                         params=full),
        "csr_split_edge_fields": lambda: run_case(tsm._edge_mod, _csr_graph(), np.float64, 1e-6,
                                                  edge_fields=("b", "w"), piece=3),
        "csr_gat_no_dot": lambda: run_case(tsm._gat_mod, _csr_graph(), np.float64, 1e-6,
                                           dot=False, node_heads=(True, True), H=2, piece=4),
        "blocks_masked_rows_f32": lambda: run_case(_masked_rows, segs, np.float32, 2e-4),
        "csr_split_masked_rows": lambda: run_case(_masked_rows, _csr_graph(), np.float32, 2e-4,
                                                  piece=3),
    }


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    import sim_support
    sim_support.prepare_simulator()
    import test_cuda_sim as ts
    ts._kernels()
    cases = _cases()
    assert sorted(cases) == sorted(SIM_CASES)
    for n in sys.argv[1:] or SIM_CASES:
        cases[n]()
    print("ALL OK")
