"""The Tiga-style front end: `tg.MessagePassing` programs and the `tg.online_softmax` reducer.

    class FullAttention(tg.MessagePassing):
        reducer = tg.online_softmax()
        def edge(self, src, dst, edge, scale):
            score = (src.key * dst.query).sum(axis=-1) * scale
            return self.reducer(score, src.value)

    out = FullAttention()(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.125)

`edge()` is traced once per call signature (tiga_numba.tracing) and the recognised form is
lowered onto the same plan/kernels as the functional API (`functional.run_forward`), or onto
the fused score-network kernels (`edge_mlp`) for `tg.nn.trace` scores. See docs/program.md.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Mapping

import numpy as np

from . import arrays
from .score_mod import leaf_name as sm_leaf_name
from .interop import foreign_arrays, is_foreign, to_native
from .plan import ir_stage
from .tracing import TracedEdge, is_score_net, record_reduce, trace_edge

__all__ = ["MessagePassing", "online_softmax", "OnlineSoftmaxReducer"]

ROLES = ("src", "dst", "edge")
_GEOMETRIC_NDIM = {"displacement": 2, "distance": 1}  # Graph.radius/knn edge fields
_EDGE_PARAMS = {}  # edge function -> its params (inspect.signature is slow per call)


# --------------------------------------------------------------------------- the reducer
class OnlineSoftmaxReducer:
    """The streaming softmax-weighted sum over each destination's incoming edges.

    Inside `edge()`, `reducer(score, value)` records the reduction (nothing is computed).
    `block_prune_threshold=rho` (0 < rho <= 1) turns on approximate tile admission: a
    (query block, key tile) is skipped when its max score < running block max + ln(rho)."""

    def __init__(self, block_prune_threshold=None):
        self.block_prune_threshold = arrays.check_prune_threshold(block_prune_threshold)

    def __call__(self, score, value):
        return record_reduce(self, score, value)

    def __repr__(self):
        rho = self.block_prune_threshold
        return "online_softmax()" if rho is None else f"online_softmax(block_prune_threshold={rho:g})"


def online_softmax(block_prune_threshold=None):
    """The online-softmax reducer; `block_prune_threshold` in (0, 1] makes it approximate."""
    return OnlineSoftmaxReducer(block_prune_threshold)


# --------------------------------------------------------------------------- call inputs
def _xp(library):
    if library == "numpy":
        return np
    import cupy
    return cupy


class _Call:
    """One call's validated inputs: role arrays, params, graph, array library."""

    def __init__(self, program, graph, src, dst, edge, params):
        from .graph import Graph
        cls = type(program).__name__
        if graph is None:
            raise TypeError(f"{cls}() needs graph= (a tiga_numba.Graph)")
        if not isinstance(graph, Graph):
            raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
        self.graph = graph
        given_roles = {}
        libs = {}
        for role, given in (("src", src), ("dst", dst), ("edge", edge)):
            if given is None:
                given = {}
            if not isinstance(given, Mapping):
                raise TypeError(f"{role}= must be a dict of field name -> array, got "
                                f"{type(given).__name__}")
            for name, a in given.items():
                if not isinstance(name, str) or not name.isidentifier():
                    raise TypeError(f"{role} field names must be identifiers, got {name!r}")
                libs[f"{role}[{name!r}]"] = arrays.library_of(f"{role}[{name!r}]", a)
            given_roles[role] = given
        # The library check comes before any conversion: a mixed call must be a TypeError even
        # where cupy is not installed.
        if len(set(libs.values())) > 1:
            desc = ", ".join(f"{n} is {lib}" for n, lib in libs.items())
            raise TypeError(f"all fields must come from one array library (mixed numpy/cupy): {desc}")
        sizes = {"src": graph.num_src, "dst": graph.num_dst, "edge": graph.num_edges}
        size_name = {"src": "graph.num_src", "dst": "graph.num_dst", "edge": "graph.num_edges"}
        self.roles = {}
        for role, given in given_roles.items():
            fields = {}
            for name, a in given.items():
                label = f"{role}[{name!r}]"
                a = arrays.as_library_array(a, libs[label])
                if a.ndim == 0:
                    raise ValueError(f"{label} must have a leading axis of length "
                                     f"{size_name[role]}={sizes[role]}, got a 0-d array")
                if a.shape[0] != sizes[role]:
                    raise ValueError(f"{label} has {a.shape[0]} rows (axis 0) but "
                                     f"{size_name[role]} is {sizes[role]}")
                if role == "edge":
                    a = self._to_kernel_order(a, libs[label])
                fields[name] = a
            self.roles[role] = fields
        self.library = next(iter(libs.values())) if libs else "numpy"
        # Geometric graphs provide edge fields of their own; a user edge field of the same name wins.
        self.graph_fields = [n for n in graph.edge_field_names if n not in self.roles["edge"]]
        self.params = self._bind_params(program, params)

    def _edge_permutation(self, library):
        """Graph.edge_permutation in `library` (None: the constructor's edge order is the CSR
        order the kernels use)."""
        perm = self.graph.edge_permutation
        if perm is None or library == "numpy":
            return perm
        import cupy   # one copy per device: an index array must live where the fields do
        return self.graph._cached(("edge_permutation", library, cupy.cuda.Device().id),
                                  lambda: arrays.as_library_array(perm, library))

    def _to_kernel_order(self, a, library):
        """A per-edge field given in the graph constructor's edge order (as PyG's edge_attr
        follows edge_index), gathered into the CSR order the kernels read."""
        perm = self._edge_permutation(library)
        return a if perm is None else a[perm]

    def edge_grads_in_input_order(self, grads):
        """`grads` with its per-edge gradients moved from the kernels' CSR order back to the
        constructor's order (the graph's own fields, e.g. a radius graph's, are in CSR order)."""
        perm = self._edge_permutation(self.library)
        if perm is not None:
            for name, g in grads["edge"].items():
                if g is not None and name not in self.graph_fields:
                    grads["edge"][name] = g.copy()
                    grads["edge"][name][perm] = g
        return grads

    @staticmethod
    def _edge_params(program):
        """(named params of edge() after (self, src, dst, edge), takes **kwargs), per class."""
        edge_fn = type(program).edge
        cached = _EDGE_PARAMS.get(edge_fn)
        if cached is not None:
            return cached
        sig = inspect.signature(edge_fn)
        ps = list(sig.parameters.values())
        positional = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 4:
            raise TypeError(f"{type(program).__name__}.edge must take (self, src, dst, edge, "
                            f"**params), got {sig}")
        extra_params = ps[4:]
        takes_any = any(p.kind == p.VAR_KEYWORD for p in extra_params)
        named = {p.name: p for p in extra_params
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        _EDGE_PARAMS[edge_fn] = (named, takes_any)
        return named, takes_any

    @staticmethod
    def _bind_params(program, params):
        cls = type(program).__name__
        named, takes_any = _Call._edge_params(program)
        bound = {}
        for name, value in params.items():
            if name not in named and not takes_any:
                expected = ", ".join(named) or "none"
                raise TypeError(f"{cls}.edge() takes no param {name!r} (its params: {expected})")
            bound[name] = value
        for name, p in named.items():
            if name not in bound:
                if p.default is inspect.Parameter.empty:
                    raise TypeError(f"{cls}.edge() needs the param {name!r}: pass it as "
                                    f"program(graph=..., src=..., dst=..., {name}=...)")
                bound[name] = p.default
        return bound

    def field(self, role, name):
        if role == "edge" and name in self.graph_fields:
            return self.graph.edge_field(name)  # materialised: only the bias path reads it
        return self.roles[role][name]

    def signature(self, program):
        """What the trace depends on (and a bit more: dtypes, graph kind, so that a new kind of
        call is traced afresh rather than trusted)."""
        parts = []
        for role in ROLES:
            parts.append(tuple(sorted((n, a.ndim, np.dtype(a.dtype).str)
                                      for n, a in self.roles[role].items())))
        attrs = tuple(sorted((k, id(v)) for k, v in vars(program).items()
                             if isinstance(v, OnlineSoftmaxReducer) or is_score_net(v)))
        return (tuple(parts), tuple(self.graph_fields), tuple(sorted(self.params)),
                tuple(sorted(self.head_params())), self.graph.kind, attrs)

    def head_params(self):
        """Params given as 1-D arrays: per-head params (shape (H,)) inside edge()."""
        return {n for n, v in self.params.items()
                if getattr(v, "ndim", 0) == 1 and hasattr(v, "dtype")}

    def head_param_value(self, name):
        v = self.params[name]
        lib = arrays.library_of(f"param {name!r}", v)
        if lib != self.library:
            raise TypeError(f"param {name!r} is a {lib} array but the fields are {self.library} "
                            "(mixed numpy/cupy)")
        return arrays.as_library_array(v, lib, f"param {name!r}")

    def trace_fields(self):
        fields = {role: {n: a.ndim for n, a in self.roles[role].items()} for role in ROLES}
        for n in self.graph_fields:
            fields["edge"][n] = _GEOMETRIC_NDIM.get(n, 2)
        return fields

    def is_float_param(self, name):
        """Whether the scalar param `name` was given as a floating-point number (a Python or
        numpy float, or a 0-d float array)."""
        v = self.params[name]
        if isinstance(v, (bool, np.bool_)):
            return False
        if isinstance(v, (float, np.floating)):
            return True
        dtype = getattr(v, "dtype", None)
        return dtype is not None and getattr(v, "ndim", None) == 0 and (
            np.dtype(dtype).kind == "f" or str(dtype) == "bfloat16")

    def param_value(self, name):
        v = self.params[name]
        if hasattr(v, "ndim") and getattr(v, "ndim", None) == 0 and not isinstance(v, np.generic):
            v = v.item()  # a 0-d numpy/cupy array holding the scalar
        if getattr(v, "ndim", 0) > 1 and hasattr(v, "shape"):
            raise ValueError(f"param {name!r} must be a number (a scalar param) or a 1-D array of "
                             f"shape (H,) (a per-head param), got an array of shape {tuple(v.shape)}")
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"param {name!r} must be a real number (a scalar param) or a numpy / cupy "
                            f"array of shape (H,) (a per-head param), got {type(v).__name__}")
        return float(v)


# --------------------------------------------------------------------------- lowering
def _dot_factor(factor, values):
    """The number the dot product is scaled by (`scale`, `scale / cap`, ...), evaluated from
    this call's params; a non-finite one names its expression and params rather than reaching
    the kernels' check as a bad `scale`."""
    with np.errstate(all="ignore"):   # 1 / cap at cap = 0: reported below, by name
        value = factor.evaluate(values)
    try:
        finite = math.isfinite(float(value))
    except (TypeError, ValueError):
        return value   # the usual scale check names the type
    if not finite:
        given = ", ".join(f"{k}={v!r}" for k, v in sorted(values.items())
                          if not hasattr(v, "shape") or getattr(v, "ndim", 1) == 0)
        raise ValueError(f"the dot product's factor {factor} evaluates to {value} for this "
                         f"call's params ({given}); it must be finite")
    return value


class _Lowered:
    """The traced form bound to one call's arrays: runs forward, and backward for vjp."""

    def __init__(self, traced: TracedEdge, call: _Call, for_grad=False):
        self.traced = traced
        self.call = call
        self.front_notes = []
        self.trace_hit = None   # whether the trace came from the program's cache (_lower sets it)
        self.rho = traced.reducer.block_prune_threshold
        self.values = values = {n: call.param_value(n) for n in traced.param_names()}
        # the scalar params a vjp differentiates: the floating-point ones (an int is a count or
        # an index, as integer fields get no gradient)
        self.learned = {n for n in values if call.is_float_param(n)} if for_grad else set()
        self.lowered_scalars = {}
        self.factor = None   # the dot product's factor (a ScalarExpr), where there is a dot product
        score = traced.score
        self.value = call.field("src", traced.value.name)
        if traced.kind == "net":
            if self.rho is not None:
                raise NotImplementedError(
                    f"tile pruning (block_prune_threshold={self.rho:g}) is not implemented for "
                    "score-network (tg.nn.trace) programs; use online_softmax() without it")
            return
        xp = _xp(call.library)
        if traced.kind == "modified":
            self._lower_modifier(xp, values)
            return
        if score.dot is not None:
            s, d = score.dot
            self.q = call.field("dst", d.name)
            self.k = call.field("src", s.name)
            self.factor = score.dot_factor
            self.scale = _dot_factor(self.factor, values)
        else:
            self.q = self.k = None
            self.scale = 1.0
        # (field, its array, the coefficient's value, the coefficient's expression) per term
        self.bias_terms = [(f, call.field("edge", f.name), c.evaluate(values), c)
                           for f, c in score.biases]
        heads = self._heads()
        self.edge_bias = self._combine_bias(xp, heads)
        if score.dot is None:
            # A precomputed per-edge score: the same kernels with zero-width q and k.
            v = self.value
            if v.ndim == 2 and heads == 1:
                self.q = xp.empty((call.graph.num_dst, 0), dtype=v.dtype)
                self.k = xp.empty((call.graph.num_src, 0), dtype=v.dtype)
            else:
                if v.ndim == 2:
                    self.value = v = v[:, None, :]
                self.q = xp.empty((call.graph.num_dst, heads, 0), dtype=v.dtype)
                self.k = xp.empty((call.graph.num_src, v.shape[1], 0), dtype=v.dtype)

    def _lower_modifier(self, xp, values):
        """q, k (zero-width without a dot product), scale and the bound modifier tree."""
        from . import score_mod as sm
        call, score = self.call, self.traced.score
        self.edge_bias = None
        self.bias_terms = []
        leaf_values = {}
        learned = {}   # scalar leaves a vjp differentiates -> their expressions
        for text, se in score.scalars.items():
            if se.params() & self.learned:
                learned[sm.Expr("scalar", (), text)] = se
            else:
                leaf_values[sm.Expr("scalar", (), text)] = se.evaluate(values)
        for x in sm.leaves(score.expr):
            if x.op == "head":
                leaf_values[x] = call.head_param_value(x.attr)
            elif x.op == "node":
                leaf_values[x] = call.field(*x.attr)
            elif x.op == "edge":
                leaf_values[x] = call.field("edge", x.attr)
        if score.dot is not None:
            s, d, self.factor = score.dot
            self.q = call.field("dst", d.name)
            self.k = call.field("src", s.name)
            self.scale = _dot_factor(self.factor, values)
        else:
            self._gather_only_inputs(xp, leaf_values)
        self._bind_modifier(xp, score.expr, leaf_values, learned)

    def _bind_modifier(self, xp, tree, leaf_values, learned):
        """The bound modifier. A vjp's float scalar leaves become per-head leaves holding the
        scalar once per head (the same value in every head, so the same scores), whose (H,)
        gradients the kernels already give: summed over the heads they are the scalar's."""
        from . import score_mod as sm
        if learned:
            heads = self._heads()
            swap = {}
            for leaf, se in learned.items():
                swap[leaf] = head = sm.Expr("head", (), leaf.attr)
                leaf_values[head] = xp.full((heads,), se.evaluate(self.values), dtype=np.float64)
                self.lowered_scalars[head] = se
            tree = sm.substitute(tree, swap)
            self.front_notes.append(
                "front end: the scalar(s) " + ", ".join(str(x.attr) for x in learned)
                + " of the score modifier are read per head (one value in every head), which gives "
                "their gradient")
        self.modifier = sm.BoundModifier(tree, leaf_values, sm.Layout(tree).differentiable())

    def _gather_only_inputs(self, xp, leaf_values):
        """q, k of zero width and the value with a head axis, for a score with no dot product."""
        call = self.call
        # no dot product: zero-width q and k, the heads from the fields / params / value
        self.scale = 1.0
        heads = {int(a.shape[1]) for x, a in leaf_values.items()
                 if x.op in ("node", "edge") and a.ndim == 2 and a.shape[1] != 1}
        heads |= {int(a.shape[0]) for x, a in leaf_values.items() if x.op == "head"}
        if len(heads) > 1:
            raise ValueError(f"the fields and params of the score disagree on the number of "
                             f"heads: {sorted(heads)}")
        v = self.value
        if heads:
            H = heads.pop()
        else:
            H = 1 if v.ndim == 2 else int(v.shape[1])
        if v.ndim == 2 and H == 1:
            self.q = xp.empty((call.graph.num_dst, 0), dtype=v.dtype)
            self.k = xp.empty((call.graph.num_src, 0), dtype=v.dtype)
        else:
            if v.ndim == 2:
                self.value = v = v[:, None, :]
            self.q = xp.empty((call.graph.num_dst, H, 0), dtype=v.dtype)
            self.k = xp.empty((call.graph.num_src, v.shape[1], 0), dtype=v.dtype)

    def _heads(self):
        if self.q is not None:
            return 1 if self.q.ndim == 2 else int(self.q.shape[1])
        heads = {int(a.shape[1]) for _, a, _, _ in self.bias_terms if a.ndim == 2 and a.shape[1] != 1}
        if len(heads) > 1:
            raise ValueError(f"edge fields in the score disagree on the number of heads: {sorted(heads)}")
        if heads:
            return heads.pop()
        return 1 if self.value.ndim == 2 else int(self.value.shape[1])

    def _combine_bias(self, xp, heads):
        terms = self.bias_terms
        for f, a, _, _ in terms:
            if not np.issubdtype(np.dtype(a.dtype), np.floating):
                raise TypeError(f"{f.ref} is added to the score and must be floating point, "
                                f"got {a.dtype}")
            if a.ndim > 2 or (a.ndim == 2 and a.shape[1] not in (1, heads)):
                raise ValueError(f"{f.ref} must have shape ({self.call.graph.num_edges},) or "
                                 f"({self.call.graph.num_edges}, {heads}) to be added to the score, "
                                 f"got {tuple(a.shape)}")
        if not terms:
            return None
        if len(terms) == 1 and terms[0][2] == 1.0:
            return terms[0][1]  # the functional layer broadcasts it to (E, H)
        acc = arrays.accumulation_dtype(terms[0][1].dtype)
        total = xp.zeros((self.call.graph.num_edges, heads), dtype=acc)
        for _, a, c, _ in terms:
            total += c * (a[:, None] if a.ndim == 1 else a).astype(acc, copy=False)
        names = " + ".join(f.ref for f, _, _, _ in terms)
        self.front_notes.append(f"front end: combined {names} (with their factors) into one "
                                f"({self.call.graph.num_edges}, {heads}) edge-bias array")
        return total

    # ------------------------------------------------------------------ forward
    def forward(self):
        if self.traced.kind == "net":
            from . import edge_mlp
            self.net_args = [edge_mlp.FieldArg(f.role, f.name, self._net_arg_array(f))
                             for f in self.traced.score.net.args]
            out, self.state, plan = edge_mlp.forward(self.call.graph, self.traced.score.net.net,
                                                     self.net_args, self.value, return_state=True,
                                                     value_name=f"src.{self.traced.value.name}")
            self.out = out
            return out, plan
        from . import functional
        try:
            out, self.stats, plan = functional.run_forward(
                self.q, self.k, self.value, self.call.graph, scale=self.scale,
                block_prune_threshold=self.rho, edge_bias=self.edge_bias,
                score_mod=getattr(self, "modifier", None))
        except (TypeError, ValueError) as exc:
            # The functional layer names q, k, v, edge_bias: say which fields those are.
            raise type(exc)(f"{exc} [{self.roles_note()}]") from exc
        self.out = out
        return out, plan

    def roles_note(self):
        score = self.traced.score
        parts = []
        if self.traced.kind == "modified":
            parts.append(f"score modifier = {self.modifier.tree}")
        if score.dot is not None:
            s, d = score.dot[:2]
            parts += [f"q = {d.ref}", f"k = {s.ref}"]
        else:
            parts.append("q, k = zero-width (precomputed edge score)")
        parts.append(f"v = {self.traced.value.ref}")
        # a modified score is a traced expression, whose unknown attributes refuse themselves
        # (NotImplementedError): it has no biases, and asking must not replace the error noted
        biases = None if self.traced.kind == "modified" else getattr(score, "biases", None)
        if biases:
            parts.append(f"edge_bias = {' + '.join(f.ref for f, _ in biases)}")
        return f"in {self.traced.program}.edge(): " + ", ".join(parts)

    def _net_arg_array(self, f):
        # Geometric edge fields are computed per edge inside the fused kernel from the graph's
        # positions: pass None rather than materialising an (E, 3) array here.
        if f.role == "edge" and f.name in self.call.graph_fields:
            return None
        return self.call.roles[f.role][f.name]

    # ------------------------------------------------------------------ backward
    def backward(self, dout):
        grads = {"src": {}, "dst": {}, "edge": {}, "params": {}, "positions": None}

        def add(role, name, g):
            if g is None:
                return
            cur = grads[role].get(name)
            grads[role][name] = g if cur is None else cur + g

        if self.traced.kind == "net":
            from . import edge_mlp
            net_call = self.traced.score.net
            res = edge_mlp.backward(self.call.graph, net_call.net, self.net_args, self.value,
                                    self.state, dout)
            for f, g in zip(net_call.args, res.get("args", [])):
                add(f.role, f.name, g)
            add("src", self.traced.value.name, res.get("value"))
            for pname, g in (res.get("params") or {}).items():
                grads["params"][f"{net_call.attr}.{pname}"] = g
            grads["positions"] = res.get("positions")
            return self.call.edge_grads_in_input_order(grads), res.get("plan")
        from . import functional
        score = self.traced.score
        scalar_grads = []   # (scalar expression, d loss / d its value) per scalar of the score
        if self.traced.kind == "modified":
            dq, dk, dv, dbias, mod_grads, plan = functional.run_backward(
                dout, self.q, self.k, self.value, self.out, self.stats, self.call.graph,
                scale=self.scale, score_mod=self.modifier)
            for x, g in mod_grads.items():
                if x in self.lowered_scalars:
                    scalar_grads.append((self.lowered_scalars[x], _sum64(g)))
                elif x.op == "head":
                    grads["params"][x.attr] = g
                elif x.op == "node":
                    add(x.attr[0], x.attr[1], g)
                else:
                    add("edge", x.attr, g)
                    if x.attr in self.call.graph_fields:
                        gp = _geometric_positions_grad(self.call.graph, x.attr, g)
                        cur = grads["positions"]
                        grads["positions"] = gp if cur is None else cur + gp
        else:
            dq, dk, dv, dbias, plan = functional.run_backward(
                dout, self.q, self.k, self.value, self.out, self.stats, self.call.graph,
                scale=self.scale, edge_bias=self.edge_bias)
        if score.dot is not None:
            s, d = score.dot[:2]
            if self.factor.params() & self.learned:
                scalar_grads.append((self.factor, self._dot_factor_grad(dq, dout)))
            add("dst", d.name, dq)
            add("src", s.name, dk)
        vname = self.traced.value.name
        v_given = self.call.roles["src"][vname]
        add("src", vname, dv.reshape(v_given.shape) if dv.shape != v_given.shape else dv)
        for f, a, c, c_expr in self.bias_terms:
            g = dbias if dbias.ndim == 2 else dbias[:, None]
            if a.ndim == 1:
                g = g.sum(axis=1)
            elif a.shape[1] == 1 and g.shape[1] != 1:
                g = g.sum(axis=1, keepdims=True)
            if c_expr.params() & self.learned:   # d loss / d c = <d loss / d (c a), a>
                scalar_grads.append((c_expr, _vdot64(g, a)))
            g = (c * g).astype(a.dtype, copy=False)
            add("edge", f.name, g)
            if f.name in self.call.graph_fields:
                gp = _geometric_positions_grad(self.call.graph, f.name, g)
                cur = grads["positions"]
                grads["positions"] = gp if cur is None else cur + gp
        self._chain_scalar_grads(grads, scalar_grads, dv.dtype)
        return self.call.edge_grads_in_input_order(grads), plan

    def _dot_factor_grad(self, dq, dout):
        """d loss / d F for the dot product's factor F (z = F <q, k>): dq = F sum_j dz_ij k_j,
        so the derivative sum_ij dz_ij <q_i, k_j> is <q, dq> / F. At F = 0 that quotient is
        undefined: the backward runs once more with q = 0 and factor 1 (the same scores z,
        so the same probabilities), whose dq is sum_j dz_ij k_j itself."""
        if self.scale != 0:
            return _vdot64(self.q, dq) / self.scale
        from . import functional
        zero_q = _xp(self.call.library).zeros_like(self.q)
        # the forward's m and l without its record (whose scale is 0): the scores of this run
        # are the forward's exactly, only the factor that dq carries differs
        stats = functional.AttentionStats(self.stats.m, self.stats.l)
        res = functional.run_backward(
            dout, zero_q, self.k, self.value, self.out, stats, self.call.graph, scale=1.0,
            edge_bias=self.edge_bias, score_mod=getattr(self, "modifier", None))
        return _vdot64(self.q, res[0])

    def _chain_scalar_grads(self, grads, scalar_grads, dtype):
        """grads["params"][name] of each float scalar param: the chain rule from the gradients
        of the scalars the score reads (the dot product's factor, an edge bias's coefficient,
        a modifier's scalar leaf) through their expressions' derivatives (0-d arrays, in the
        gradients' floating-point dtype)."""
        total = {}
        for expr, g in scalar_grads:
            for name, slope in expr.derivatives(self.values).items():
                if name in self.learned:
                    total[name] = total.get(name, 0.0) + g * slope
        xp = _xp(self.call.library)
        dtype = dtype if np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize >= 4 else np.float32
        for name, g in total.items():
            grads["params"][name] = xp.asarray(g, dtype=dtype)


def _sum64(a):
    """sum of an array's elements in float64 (a 0-d array of its library)."""
    return a.astype(np.float64, copy=False).sum()


def _vdot64(a, b, block=1 << 22):
    """<a, b> over all elements in float64, about `block` elements at a time (no float64 copy
    of a large array; a 0-d array of the arrays' library)."""
    total = 0.0
    if a.size == 0:
        return total
    a = a.reshape(a.shape[0], -1)
    b = b.reshape(b.shape[0], -1)
    rows = max(1, block // a.shape[1])
    for r in range(0, a.shape[0], rows):
        total = total + (a[r:r + rows].astype(np.float64) * b[r:r + rows].astype(np.float64)).sum()
    return total


def _segment_sums(xp, values, indptr):
    """Row sums of `values` (E, C) over CSR segments, by prefix sums in float64: fixed order
    (deterministic on both backends, no atomics), one pass, no (E,)-sized scatter."""
    cs = xp.zeros((values.shape[0] + 1, values.shape[1]), dtype=np.float64)
    xp.cumsum(values.astype(np.float64, copy=False), axis=0, out=cs[1:])
    return cs[indptr[1:]] - cs[indptr[:-1]]


def _geometric_positions_grad(graph, name, grad):
    """Chain a gradient w.r.t. a Graph.radius/knn edge field used as a score bias back to the
    node positions: displacement_e = pos[src] - pos[dst], distance_e = |displacement_e|."""
    pos = graph._positions
    xp = np if isinstance(pos, np.ndarray) else __import__("cupy")
    disp = graph.edge_field("displacement").astype(np.float64, copy=False)
    grad = xp.asarray(grad, dtype=np.float64)
    if name == "distance":
        dist = xp.sqrt((disp * disp).sum(axis=1))
        g = grad.reshape(grad.shape[0], -1).sum(axis=1)  # (E,) or (E, 1)
        contrib = disp * (g / xp.where(dist > 0, dist, 1.0))[:, None]  # d|d|/dd = d/|d|; 0 at 0
    else:
        contrib = grad.reshape(disp.shape)
    device = "cpu" if xp is np else "cuda"
    rel = graph.realize(device)
    t = graph.realize_transpose(device)
    out = _segment_sums(xp, contrib[t.perm], t.indptr)  # + at each source
    out -= _segment_sums(xp, contrib, rel.indptr)        # - at each destination
    return out.astype(pos.dtype, copy=False)


# --------------------------------------------------------------------------- programs
class MessagePassing:
    """Base class of Tiga-style programs: subclass it, set `reducer = tg.online_softmax()`
    and define `edge(self, src, dst, edge, **params)` returning `self.reducer(score, value)`.

    Call it as `program(graph=g, src={...}, dst={...}, edge={...}, **params)`. Fields are
    arrays whose axis 0 runs over graph.num_src (src), graph.num_dst (dst) or graph.num_edges
    (edge). Every given field must be read by edge(); a field edge() reads but was not given
    raises ValueError naming role and field."""

    def __getstate__(self):
        """A pickled program carries its definition (its attributes: reducer, score networks,
        settings), not what calls left on it (traces, plans, explain() records): those are
        caches of this process, rebuilt on first use (dask workers, multiprocessing)."""
        state = dict(self.__dict__)
        state.pop("_tiga_state", None)
        return state

    def _state(self):
        st = self.__dict__.get("_tiga_state")
        if st is None:
            st = {"traces": {}, "last": None, "forward_plan": None, "backward_plan": None,
                  "last_plan": None, "notes": [], "failure": None}
            self.__dict__["_tiga_state"] = st
        return st

    def edge(self, src, dst, edge):
        """Defined by each program: the score and value of edge (j -> i) from `src` (fields of
        j), `dst` (fields of i), `edge` (per-edge fields) and the call's params, returned as
        ``self.reducer(score, value)``; traced once per call signature, never run on data."""
        raise NotImplementedError(f"{type(self).__name__} must define edge(self, src, dst, edge, "
                                  "**params) returning self.reducer(score, value)")

    # ------------------------------------------------------------------ tracing
    def _lower(self, graph, src, dst, edge, params, for_grad=False):
        call = _Call(self, graph, src, dst, edge, params)
        st = self._state()
        key = call.signature(self)
        traced = st["traces"].get(key)
        hit = traced is not None   # recorded with the call's plan once it completes (_record)
        if traced is None:
            traced = trace_edge(self, call.trace_fields(), sorted(call.params), call.head_params())
            unread = [(role, name) for role in ROLES for name in call.roles[role]
                      if (role, name) not in traced.reads]
            if unread:
                names = ", ".join(f"{r}[{n!r}]" for r, n in unread)
                raise ValueError(f"{type(self).__name__}.edge() never reads the given field(s) "
                                 f"{names}; pass only the fields edge() uses")
            st["traces"][key] = traced
        lowered = _Lowered(traced, call, for_grad)
        lowered.trace_hit = hit
        return lowered

    def traced_form(self, graph, src=None, dst=None, edge=None, **params):
        """The recognised form of edge() for this call signature (no kernel runs)."""
        return self._lower(graph, src, dst, edge, params).traced

    # ------------------------------------------------------------------ running
    @foreign_arrays
    def __call__(self, graph=None, src=None, dst=None, edge=None, **params):
        with self._noting_failure("{name}(...)"):
            lowered = self._lower(graph, src, dst, edge, params)
            out, plan = lowered.forward()
        self._record(lowered, plan, None)
        return out

    @foreign_arrays
    def vjp(self, graph=None, src=None, dst=None, edge=None, **params):
        """Forward plus a function from the output cotangent to gradients:

            out, vjp = program.vjp(graph=g, src=..., dst=..., scale=...)
            grads = vjp(dout)   # {"src": {...}, "dst": {...}, "edge": {...}, "params": {...},
                                #  "positions": array or None}

        Only fields that reach the output appear; a field used twice (key and value) gets the
        sum. Float scalar params (scale, a soft-cap) get a 0-d gradient; int params none."""
        with self._noting_failure("{name}.vjp(...)"):
            lowered = self._lower(graph, src, dst, edge, params, for_grad=True)
            if lowered.rho is not None:
                raise NotImplementedError(
                    f"{type(self).__name__}.vjp: the reducer is tile-pruned (block_prune_threshold="
                    f"{lowered.rho:g}), which is approximate and has no backward; use "
                    "tg.online_softmax() without block_prune_threshold for training")
            out, plan = lowered.forward()
        self._record(lowered, plan, None)
        program = self

        def vjp(dout):
            with program._noting_failure("the vjp(dout) of {name}.vjp"):
                if is_foreign(dout):   # a torch dout for a numpy call: viewed, as every input
                    dout = to_native(dout, "dout")
                grads, bplan = lowered.backward(dout)
            program._record(lowered, plan, bplan)
            return grads

        return out, vjp

    def _noting_failure(self, what):
        """An exception inside is kept for explain() (the program's and tg.explain()), then
        re-raised: explain() never passes an earlier call off as the one that failed."""
        from .functional import noting_failure
        return noting_failure(what.format(name=type(self).__name__),
                              keep=lambda text: self._state().__setitem__("failure", text))

    def _record(self, lowered, fplan, bplan):
        st = self._state()
        st["failure"] = None
        st["last"] = lowered
        st["forward_plan"] = fplan
        st["backward_plan"] = bplan
        st["last_plan"] = bplan if bplan is not None else fplan

    # ------------------------------------------------------------------ inspection
    @property
    def last_plan(self):
        """The plan of the last kernel this program ran (backward after a vjp(dout)), or None."""
        return self._state()["last_plan"]

    def explain(self):
        """What the last call ran: traced form, lowering, and the kernel plan(s)."""
        st = self._state()
        name = type(self).__name__
        lowered = st["last"]
        failure = st["failure"]
        if lowered is None:
            if failure:
                return (f"{name} (tiga_numba.MessagePassing program): not called yet (no call has "
                        f"completed; the most recent one failed: {failure})")
            return (f"{name} (tiga_numba.MessagePassing program): not called yet; explain() "
                    "describes the last call")
        failed = [f"the most recent call failed ({failure}); the last call that completed:"] \
            if failure else []
        traced = lowered.traced
        lines = failed + [f"program: {name} (tiga_numba.MessagePassing)",
                 f"traced edge(): {traced.describe()}",
                 f"trace cache: {len(st['traces'])} signature(s) traced; last call "
                 f"{'reused a trace' if lowered.trace_hit else 'traced edge()'}"]
        if traced.kind == "net":
            net = traced.score.net
            lines.append(f"lowered to: fused score-network attention (tiga_numba.edge_mlp), "
                         f"network {net.attr}, value {traced.value.ref}")
        elif traced.kind == "modified":
            score = traced.score
            mod = lowered.modifier
            if score.dot is not None:
                s, d = score.dot[:2]
                low = (f"lowered to: attention kernel with q = {d.ref}, k = {s.ref}, "
                       f"v = {traced.value.ref}, s = {lowered.scale:.6g} * <k, q>")
            else:
                low = (f"lowered to: gather-only attention kernel (no dot product, zero-width "
                       f"q/k), v = {traced.value.ref}")
            lines.append(low)
            lines.append(f"compiled score modifier: f = {mod.tree}")
            if mod.grad_leaves:
                lines.append("modifier gradients: " + ", ".join(
                    sm_leaf_name(x) for x in mod.grad_leaves))
        else:
            score = traced.score
            if score.dot is not None:
                s, d = score.dot
                low = (f"lowered to: attention kernel with q = {d.ref}, k = {s.ref}, "
                       f"v = {traced.value.ref}, scale = {lowered.scale:.6g}")
            else:
                low = (f"lowered to: attention kernel over a precomputed per-edge score "
                       f"(zero-width q/k), v = {traced.value.ref}")
                lines.append("note: the score is a materialized per-edge input field "
                             f"({', '.join(f.ref for f, _ in score.biases)}); the kernel "
                             "materializes no probability tensor")
            if score.biases and score.dot is not None:
                low += f", edge bias = {' + '.join(f.ref for f, _ in score.biases)}"
            lines.append(low)
        lines.extend(lowered.front_notes)
        for title, plan in (("forward", st["forward_plan"]), ("backward", st["backward_plan"])):
            if plan is None:
                continue
            lines.append(f"-- last {title} kernel --")
            text = plan.explain() if hasattr(plan, "explain") else str(plan)
            lines.extend("  " + ln for ln in text.splitlines())
        return "\n".join(lines)

    def ir(self, stage):
        """Compiled artefact `stage` of the kernel that ran last ("llvm", "asm" on CPU;
        "llvm", "ptx" on CUDA). KeyError, listing the available stages, for anything else."""
        plan = self._state()["last_plan"]
        stages = {} if plan is None else (getattr(plan, "run_info", None) or {}).get("ir") or {}
        if plan is None:
            raise KeyError(f"IR stage {stage!r} is not available: {type(self).__name__} has "
                           "not run yet (available: none)")
        return ir_stage(stages, stage, "for the last kernel")
