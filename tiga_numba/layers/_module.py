"""What every layer shares: PyG-named parameters, state dicts, input checks and the call protocol.

A layer holds its parameters as arrays under PyG's names and shapes (`state_dict()` /
`load_state_dict()`), and computes with a pure function of (parameters, inputs):

    out, backward = layer._apply(params, x_src, x_dst, single, graph, edge_attr)
    dx_src, dx_dst, d_edge_attr, dparams = backward(dout)

`__call__` and `vjp` wrap that function for users (foreign arrays converted through
`tiga_numba.interop`), `tiga_numba.torch` wraps the same function for autograd.
"""
from __future__ import annotations

import math

import numpy as np

from .. import arrays, interop
from ._edges import xp_of

_FLOATS = arrays.FLOAT_DTYPES   # the parameter and input dtypes (bfloat16 only on the functional path)


def _check_float(name, array):
    """TypeError naming `name` unless `array` holds float16, float32 or float64 values."""
    if np.dtype(array.dtype) not in _FLOATS:
        raise TypeError(f"{name} has unsupported dtype {array.dtype}; expected float16, float32 or float64")


def glorot(rng, shape, fan_in, fan_out, dtype):
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def kaiming_linear(rng, out_f, in_f, dtype, bias=True):
    """torch.nn.Linear's default initialisation: U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(in_f) if in_f > 0 else 0.0
    w = rng.uniform(-bound, bound, size=(out_f, in_f)).astype(dtype)
    b = rng.uniform(-bound, bound, size=(out_f,)).astype(dtype) if bias else None
    return w, b


def check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_channels(in_channels):
    """PyG's in_channels: an int, or (source, destination) ints for bipartite layers.
    -1 (PyG's lazy size, the parameters shaped at the first call) is a valid PyG request this
    package does not do (NotImplementedError): the parameters must have a shape when built, so
    that load_state_dict / state_dict work before any call."""
    pair = isinstance(in_channels, (tuple, list))
    if pair and len(in_channels) != 2:
        raise ValueError(f"in_channels must be an int or a pair of ints, got {in_channels!r}")
    for c in (in_channels if pair else (in_channels,)):
        if isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c == -1:
            raise NotImplementedError(f"in_channels={in_channels!r}: lazy sizes (-1) are not "
                                      "supported; give the input feature sizes")
    if pair:
        return tuple(check_positive("in_channels", c) for c in in_channels)
    return check_positive("in_channels", in_channels)


class Layer:
    """Base class: parameters by PyG name, state dicts, train/eval, the call protocol."""

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _FLOATS:
            raise TypeError(f"dtype must be float16, float32 or float64, got {self.dtype}")
        self._params = {}
        self.training = True

    # ------------------------------------------------------------------ parameters
    def _common_args(self, in_channels, out_channels, heads, concat, dropout, edge_dim):
        """The constructor arguments every layer takes, checked and stored under PyG's names."""
        self.in_channels = check_channels(in_channels)
        self.out_channels = check_positive("out_channels", out_channels)
        self.heads = check_positive("heads", heads)
        self.concat = bool(concat)
        self.dropout = float(dropout)
        self.edge_dim = None if edge_dim is None else check_positive("edge_dim", edge_dim)

    def _add(self, name, array):
        self._params[name] = array

    def state_dict(self):
        """{PyG name: array} (the arrays themselves, not copies)."""
        return dict(self._params)

    def named_parameters(self):
        """[(name, array)], each array once under its first name (torch's rule): an array held
        under two names (GATv2Conv's shared projection) is one parameter, so an optimiser
        stepping over this list updates it once. state_dict() keeps every name."""
        seen, out = set(), []
        for name, array in self._params.items():
            if id(array) not in seen:
                seen.add(id(array))
                out.append((name, array))
        return out

    def parameters(self):
        return [array for _, array in self.named_parameters()]

    def param_shapes(self):
        return {k: tuple(v.shape) for k, v in self._params.items()}

    def load_state_dict(self, state_dict, strict=True):
        """Copy arrays (numpy, cupy, torch tensors, ...) into the parameters by PyG name.
        Shapes must match; with strict=True, the names must match exactly. All parameters take
        the widest float dtype among the layer's `dtype` and the given arrays' (a sequence
        without a dtype of its own counts as the layer's): a float64 PyG layer's state dict
        loads into a float32 layer as float64, exactly, so `state_dict()` gives back the same
        values and the parameter gradients come back in float64; a float64 layer stays float64
        whatever it is given. The computation itself runs in x's dtype."""
        if not hasattr(state_dict, "items"):
            raise TypeError(f"state_dict must be a mapping of name -> array, got {type(state_dict).__name__}")
        given = dict(state_dict.items())
        missing = [k for k in self._params if k not in given]
        unexpected = [k for k in given if k not in self._params]
        if strict and (missing or unexpected):
            raise ValueError(f"state_dict does not match {type(self).__name__}'s parameters: "
                             f"missing {missing}, unexpected {unexpected}")
        checked, widest = {}, np.dtype(self.dtype)
        for name in self._params:
            if name not in given:
                continue
            value = interop.to_native(given[name], f"state_dict[{name!r}]")
            if hasattr(value, "dtype") and np.dtype(value.dtype) in _FLOATS:
                widest = np.promote_types(widest, value.dtype)
            if not hasattr(value, "shape"):
                value = np.asarray(value)
            want = tuple(self._params[name].shape)
            if tuple(value.shape) != want:
                raise ValueError(f"state_dict[{name!r}] must have shape {want}, got {tuple(value.shape)}")
            checked[name] = value
        kept = {}   # id -> cast array: a parameter held under two names stays one array
        for name, current in list(self._params.items()):
            xp = xp_of(current)   # each parameter stays where it is (numpy or cupy)
            if name in checked:
                value = checked[name]
                self._params[name] = (np.array(interop.to_host(value), dtype=widest, copy=True) if xp is np
                                      else xp.array(value, dtype=widest, copy=True))
            elif current.dtype != widest:
                if id(current) not in kept:
                    kept[id(current)] = current.astype(widest)
                self._params[name] = kept[id(current)]
        self.dtype = widest
        return self

    def to(self, device):
        """Move the parameters to "cpu" (numpy) or "cuda" (cupy)."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        moved = {}  # id -> moved array: one array under two names stays one array
        for name, a in self._params.items():
            if id(a) not in moved:
                if device == "cpu":
                    moved[id(a)] = interop.to_host(a)
                else:
                    import cupy
                    moved[id(a)] = cupy.asarray(a)
            self._params[name] = moved[id(a)]
        return self

    def train(self, mode=True):
        """Training mode on (or off with mode=False), as torch.nn.Module.train; returns self."""
        self.training = bool(mode)
        return self

    def eval(self):
        """Evaluation mode (train(False)); returns self."""
        return self.train(False)

    def _check_dropout(self):
        if self.dropout and self.training:
            raise NotImplementedError(
                f"{type(self).__name__}: attention dropout (dropout={self.dropout}) is not "
                "implemented; call .eval() (dropout is then inactive, as in PyG) or use dropout=0")

    # ------------------------------------------------------------------ inputs
    def _inputs(self, x, graph, edge_attr):
        """(x_src, x_dst or None, single, edge_attr 2-D or None, edge_attr was 1-D)."""
        single = not isinstance(x, (tuple, list))
        if single:
            x_src = x_dst = x
        else:
            if len(x) != 2:
                raise ValueError(f"x must be an array or a pair (x_src, x_dst), got {len(x)} items")
            x_src, x_dst = x
        if x_src is None:
            raise ValueError("x_src must be an array, got None")
        lib = arrays.library_of("x" if single else "x_src", x_src)
        names = ("x",) if single else ("x_src", "x_dst")
        for name, a in zip(names, (x_src, x_dst)):
            if a is None:
                continue
            if arrays.library_of(name, a) != lib:
                raise TypeError(f"{name} is from another array library than x_src (mixed numpy/cupy)")
            if a.ndim != 2:
                raise ValueError(f"{name} must be 2-D (nodes, features), got shape {tuple(a.shape)}")
            _check_float(name, a)
        if x_dst is not None and x_dst.dtype != x_src.dtype:
            raise TypeError(f"x_dst has dtype {x_dst.dtype} but x_src has {x_src.dtype}")
        fs, fd = self._in_pair
        if x_src.shape[1] != fs:
            raise ValueError(f"{names[0]} must have {fs} features (in_channels), got {x_src.shape[1]}")
        if x_dst is not None and x_dst.shape[1] != fd:
            raise ValueError(f"{names[-1]} must have {fd} features (in_channels), got {x_dst.shape[1]}")
        from ..graph import Graph
        from ._edges import EdgeSet
        if isinstance(graph, EdgeSet):   # one partition's edges (tiga_numba.dask tasks)
            num_in = graph.num_in
        elif not isinstance(graph, Graph):
            raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
        else:
            num_in = graph.num_edges
        if graph.num_src != x_src.shape[0]:
            raise ValueError(f"{names[0]} has {x_src.shape[0]} rows but graph.num_src is {graph.num_src}")
        if x_dst is not None and graph.num_dst != x_dst.shape[0]:
            raise ValueError(f"{names[-1]} has {x_dst.shape[0]} rows but graph.num_dst is {graph.num_dst}")
        squeeze = False
        if edge_attr is not None:
            if self.edge_dim is None:
                raise ValueError(f"edge_attr was given but {type(self).__name__} was built with "
                                 "edge_dim=None (pass edge_dim=... to use edge features)")
            if arrays.library_of("edge_attr", edge_attr) != lib:
                raise TypeError("edge_attr is from another array library than x (mixed numpy/cupy)")
            if edge_attr.ndim == 1:
                squeeze = True
                edge_attr = edge_attr[:, None]
            if edge_attr.ndim != 2 or edge_attr.shape != (num_in, self.edge_dim):
                raise ValueError(f"edge_attr must have shape ({num_in}, {self.edge_dim}) "
                                 f"(one row per edge of graph), got {tuple(edge_attr.shape)}")
            _check_float("edge_attr", edge_attr)
            # another float dtype is cast to x's (PyG would need the caller to cast); an
            # integer, bool or complex array is refused: casting it would change its values
            edge_attr = edge_attr.astype(x_src.dtype, copy=False)
        return x_src, x_dst, single, edge_attr, squeeze

    def _params_like(self, x, params=None):
        """The parameters in x's library and dtype (a view when they already are)."""
        xp = xp_of(x)
        params = self._params if params is None else params
        return {k: xp.asarray(v, dtype=x.dtype) for k, v in params.items()}

    # ------------------------------------------------------------------ calls
    def forward(self, x, graph, edge_attr=None, return_attention_weights=None):
        return self(x, graph, edge_attr, return_attention_weights)

    def __call__(self, x, graph, edge_attr=None, return_attention_weights=None):
        """out = layer(x, graph, edge_attr). With return_attention_weights=True, as PyG:
        (out, (edge_index, alpha)), edge_index (2, E') int64 (sources, destinations) and alpha
        (E', H) the softmax weights, in PyG's edge order (the caller's edges in the order given
        to the graph's constructor, less removed self-loops, then the added loops by node); the
        weights are rebuilt from the per-edge scores and the forward's row stats (an (E', H)
        array the fused kernels themselves never hold)."""
        with self._noting_failure("{name}(...)"):
            lib, (x, graph, edge_attr), _ = interop.convert_args((x, graph, edge_attr), {})
            if not return_attention_weights:
                out, _ = self._run(x, graph, edge_attr, None, want_grad=False)
                return interop.outward(out, lib)
            return interop.outward(self._with_weights(x, graph, edge_attr, None), lib)

    def _with_weights(self, x, graph, edge_attr, params):
        """(out, (edge_index, alpha)) of a forward call (native arrays), as __call__ describes."""
        weights = {}
        out, _ = self._run(x, graph, edge_attr, params, want_grad=False, weights=weights)
        es = weights["edges"]
        order = es.caller_order()
        xp = xp_of(out)
        edge_index = xp.stack([xp.take(es.cols, order), xp.take(es.rows, order)])
        alpha = xp.take(weights["alpha"], order, axis=0).astype(out.dtype, copy=False)
        return out, (edge_index, alpha)

    def vjp(self, x, graph, edge_attr=None, return_attention_weights=None):
        """out, vjp = layer.vjp(x, graph, edge_attr); vjp(dout) returns
        {"x": dx (or (dx_src, dx_dst)), "edge_attr": d_edge_attr or None, "params": {name: grad}}."""
        with self._noting_failure("{name}.vjp(...)"):
            _refuse_attention_weights(return_attention_weights)
            lib, (x, graph, edge_attr), _ = interop.convert_args((x, graph, edge_attr), {})
            out, backward = self._run(x, graph, edge_attr, None, want_grad=True)
        params = self._params
        pair = isinstance(x, (tuple, list))

        def vjp(dout):
            with self._noting_failure("the vjp(dout) of {name}.vjp"):
                dout = interop.to_native(dout, "dout")
                dx_src, dx_dst, d_ea, dparams = backward(dout)
                grads = {"x": (dx_src, dx_dst) if pair else dx_src,
                         "edge_attr": d_ea,
                         "params": {k: dparams[k].astype(params[k].dtype, copy=False) for k in params}}
                return interop.outward(grads, lib)

        return interop.outward(out, lib), vjp

    def _noting_failure(self, what):
        """A failing call is what tg.explain() reports first until a call completes, as for
        tg.attention and programs (an earlier call's plan is never passed off as this one's)."""
        from ..functional import noting_failure
        return noting_failure(what.format(name=type(self).__name__))

    def _run(self, x, graph, edge_attr, params, want_grad, weights=None):
        """Checked inputs -> (out, backward(dout) -> (dx_src, dx_dst or None, d_edge_attr, dparams)).
        For a single x, dx_dst is None and dx_src is the whole gradient. `weights`, a dict when
        given, receives the attention weights (E, H) in edge-set order ("alpha") and the edge
        set ("edges")."""
        if want_grad or self.training:
            self._check_dropout()
        x_src, x_dst, single, edge_attr, squeeze = self._inputs(x, graph, edge_attr)
        # float16 on the CPU: computed in float32 (the precision the attention kernels
        # accumulate in), results returned in float16
        half = xp_of(x_src) is np and x_src.dtype == np.float16
        if half:
            x_src, x_dst, edge_attr = (None if a is None else a.astype(np.float32)
                                       for a in (x_src, x_dst, edge_attr))
        p = self._params_like(x_src, params)
        out, backward = self._apply(p, x_src, x_dst, single, graph, edge_attr, weights=weights)

        def checked_backward(dout):
            if arrays.library_of("dout", dout) != arrays.library_of("x", x_src):
                raise TypeError("dout is from another array library than x (mixed numpy/cupy)")
            if tuple(dout.shape) != tuple(out.shape):
                raise ValueError(f"dout must have shape {tuple(out.shape)}, got {tuple(dout.shape)}")
            _check_float("dout", dout)
            xp = xp_of(x_src)
            dout = xp.ascontiguousarray(dout, dtype=out.dtype)
            dxs, dxd, d_ea, dparams = backward(dout)
            if single and dxd is not None:
                dxs, dxd = dxs + dxd, None
            elif not single and x_dst is not None and dxd is None:
                dxd = xp.zeros_like(x_dst)
            if d_ea is not None and squeeze:
                d_ea = d_ea[:, 0]
            full = {k: (dparams[k] if dparams.get(k) is not None else xp.zeros_like(v))
                    for k, v in p.items()}
            return dxs, (None if single else dxd), d_ea, full

        if half:
            return out.astype(np.float16), _in_float16(checked_backward)
        return out, checked_backward

    def __repr__(self):
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"


def _in_float16(backward):
    """A float32 layer backward taking and returning float16 (dout in, gradients out)."""
    def half_backward(dout):
        dxs, dxd, d_ea, dparams = backward(dout.astype(np.float32))
        cast = (lambda a: None if a is None else a.astype(np.float16))
        return cast(dxs), cast(dxd), cast(d_ea), {k: cast(v) for k, v in dparams.items()}
    return half_backward


def column_sums(a):
    """a.sum(axis=0) of a tall (N, F) array as one matrix-vector product (BLAS gemv): cupy's
    axis-0 reduction of a C-ordered (100000, 64) float32 array took ~2 ms on the H200, most of a
    layer's bias gradients (benchmarks/results/gpu-h200-2026-12-02d.txt, layer profile)."""
    xp = xp_of(a)
    if xp is np or a.ndim != 2:
        return a.sum(axis=0)
    return xp.ones(a.shape[0], dtype=a.dtype) @ a


def head_dots(x3, att):
    """(N, H): x3[n, h] . att[h] for x3 (N, H, C), att (H, C). numpy: one einsum loop; cupy: an
    elementwise product and a last-axis reduction (cupy's einsum turns this into transposed
    copies and a batched matmul, several times slower on the H200 for 100k x 8 x 8)."""
    if xp_of(x3) is np:
        return np.einsum("nhc,hc->nh", x3, att)
    return (x3 * att).sum(axis=-1)


def head_weighted_sums(w, x3):
    """(H, C): sum_n w[n, h] x3[n, h] for w (N, H), x3 (N, H, C). numpy: one einsum loop; cupy:
    one GEMM w.T @ x3 viewed (N, H*C), whose diagonal head blocks are the sums (H times the
    flops of the sums, a few MFLOP at these widths, instead of cupy's einsum copies)."""
    if xp_of(x3) is np:
        return np.einsum("nh,nhc->hc", w, x3)
    n, h, c = x3.shape
    full = (w.T @ x3.reshape(n, h * c)).reshape(h, h, c)
    heads = xp_of(x3).arange(h)
    return full[heads, heads]


def linear_grads(dy, x, weight):
    """For y = x @ weight.T: (dW, dx)."""
    return dy.T @ x, dy @ weight


def heads_out(out_h, concat):
    """(N, H, C) -> (N, H*C) concatenated or (N, C) head mean, as PyG."""
    n, h, c = out_h.shape
    return out_h.reshape(n, h * c) if concat else out_h.mean(axis=1)


def heads_grad(xp, dout, heads, channels, concat):
    """Gradient of heads_out w.r.t. (N, H, C), contiguous."""
    n = dout.shape[0]
    if concat:
        return xp.ascontiguousarray(dout.reshape(n, heads, channels))
    g = xp.empty((n, heads, channels), dtype=dout.dtype)
    g[...] = (dout / heads)[:, None, :]
    return g


def _refuse_attention_weights(flag):
    """vjp(..., return_attention_weights=True): the weights are a forward output only."""
    if flag:
        raise NotImplementedError(
            "vjp(..., return_attention_weights=True) is not implemented: no gradient flows through "
            "the attention weights here; call layer(x, graph, edge_attr, return_attention_weights=True) "
            "for them (docs/layers.md)")
