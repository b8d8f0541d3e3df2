"""PyTorch adapter: the fused kernels inside torch.autograd (optional; needs torch).

    import tiga_numba.torch as tgt
    out = tgt.attention(q, k, v, graph)                      # torch tensors in and out
    conv = tgt.GATConv(64, 8, heads=8)                        # a torch.nn.Module
    conv.load_state_dict(pyg_conv.state_dict())               # PyG's names and shapes
    out = conv(x, edge_index)                                 # or conv(x, graph)
    out.sum().backward()                                      # gradients through the fused backward

Tensors are viewed as numpy (CPU) or cupy (CUDA) arrays through DLPack, without a copy; results
come back as tensors the same way. Each wrapper is a `torch.autograd.Function` whose backward is
the package's fused backward (`attention_backward`, a program's or a layer's `vjp`); double
backward is not supported (create_graph=True raises RuntimeError), and a saved input or output
changed in place before the backward is refused by torch's version check. This module is the only one that imports torch at import time, and
nothing else in the package imports it.
"""
from __future__ import annotations

import weakref

import torch

from . import interop
from .functional import flash_modifier, run_backward, run_forward
from .graph import Graph
from .score_mod import ALIBI_SLOPES
from . import layers as _layers

__all__ = ["attention", "program", "GATConv", "GATv2Conv", "TransformerConv", "graph_of"]


def _native(t, name="tensor"):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor (tiga_numba.torch wraps torch tensors; "
                        f"numpy and cupy arrays go to tiga_numba itself), got {type(t).__name__}")
    if not t.is_contiguous():
        t = t.contiguous()
    return interop.to_native(t, name)


def _tensor(a):
    return None if a is None else interop.to_library(a, "torch")


def _first_order_only(backward):
    """A backward that refuses to build a graph (create_graph=True: double backward, a gradient
    penalty) instead of returning a first gradient without one, which torch's
    once_differentiable does when dout itself needs no gradient (a linear loss): the penalty
    would then be dropped silently. Runs the fused backward without recording."""
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("double backward (create_graph=True) through the fused kernels of "
                               "tiga_numba.torch is not supported: their backward is not "
                               "differentiable")
        ctx.saved_tensors   # torch's check that no saved input or output was modified in place
        with torch.no_grad():
            return backward(ctx, *grads)
    return checked


# --------------------------------------------------------------------------- attention
class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, graph, scale, softcap, alibi_slopes):
        qn, kn, vn = _native(q, "q"), _native(k, "k"), _native(v, "v")
        slopes = _native(alibi_slopes, "alibi_slopes")
        mod = flash_modifier(qn, graph, softcap, slopes,
                             grad_slopes=alibi_slopes is not None and alibi_slopes.requires_grad)
        out, stats, _ = run_forward(qn, kn, vn, graph, scale=scale, score_mod=mod)
        ctx.arrays = (qn, kn, vn, out, stats)
        ctx.graph, ctx.scale, ctx.mod = graph, scale, mod
        result = _tensor(out)
        # the backward reads these through ctx.arrays (views of the same memory); saved so that
        # torch refuses the backward when one was modified in place (`out += x` would change
        # the Delta_i = sum(dO_i O_i) it reads)
        ctx.save_for_backward(q, k, v, result, *(() if alibi_slopes is None else (alibi_slopes,)))
        return result

    @staticmethod
    @_first_order_only
    def backward(ctx, dout):
        qn, kn, vn, out, stats = ctx.arrays
        res = run_backward(_native(dout, "dout"), qn, kn, vn, out, stats, ctx.graph,
                           scale=ctx.scale, score_mod=ctx.mod)
        dslopes = None
        if ctx.mod is not None and ctx.mod.grad_leaves:
            # in the slopes' own dtype; (H,) given as (1, H) goes back as (1, H), (batch, H)
            # per-sequence slopes come back summed per sequence (BoundModifier.gathers)
            dslopes = _tensor(res[4][ALIBI_SLOPES].reshape(ctx.saved_tensors[4].shape))
        return _tensor(res[0]), _tensor(res[1]), _tensor(res[2]), None, None, None, dslopes


def attention(q, k, v, graph, *, scale=None, softcap=None, alibi_slopes=None):
    """tg.attention for torch tensors, differentiable w.r.t. q, k and v, and w.r.t.
    `alibi_slopes` (a tensor of shape (H,), or (batch, H) for a cu_seqlens relation of batch
    sequences, as flash-attn) when it requires grad; `softcap` is a number, as in tg.attention
    and flash-attn."""
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
    if isinstance(softcap, torch.Tensor):
        if softcap.requires_grad:
            raise NotImplementedError("softcap is a per-call number of tgt.attention and gets no "
                                      "gradient; detach it, or learn it with tgt.program, whose "
                                      "float scalar params get gradients")
        softcap = softcap.item()
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch tensor of shape (H,) like q, got "
                        f"{type(alibi_slopes).__name__}")
    return _Attention.apply(q, k, v, graph, scale, softcap, alibi_slopes)


# --------------------------------------------------------------------------- programs
class _Program(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, slots, *tensors):
        out, vjp = run([_native(t, f"{role}[{name!r}]") for (role, name), t in zip(slots, tensors)])
        ctx.vjp, ctx.slots = vjp, slots
        result = _tensor(out)
        ctx.save_for_backward(*tensors, result)   # in-place changes refused, as in _Attention
        return result

    @staticmethod
    @_first_order_only
    def backward(ctx, dout):
        grads = ctx.vjp(_native(dout, "dout"))
        return (None, None) + tuple(_tensor(grads.get(role, {}).get(name))
                                    for role, name in ctx.slots)


def program(prog, graph, src=None, dst=None, edge=None, **params):
    """Run a tg.MessagePassing program on torch tensors, differentiable w.r.t. every tensor in
    src / dst / edge, every per-head param given as a tensor (ALiBi slopes, a per-head
    temperature) and every 0-d float tensor param that requires grad (a soft-cap, the scale):
    their gradients are prog.vjp's grads["params"]. Other scalar params pass through as numbers.
    Score-network weights are not torch parameters and get no gradient here, nor do the
    positions of a Graph.radius / knn graph (a graph holds a detached copy of them): use
    prog.vjp (grads["params"], grads["positions"]) for those."""
    # the params that take part in autograd: per-head tensors, and 0-d tensors that require grad
    tensor_params = {name: p for name, p in params.items()
                     if isinstance(p, torch.Tensor) and (p.ndim > 0 or p.requires_grad)}
    fixed = {name: p for name, p in params.items() if name not in tensor_params}
    fields = {"src": dict(src or {}), "dst": dict(dst or {}), "edge": dict(edge or {}),
              "params": tensor_params}
    slots = [(role, name) for role in ("src", "dst", "edge", "params") for name in fields[role]]
    tensors = [fields[role][name] for role, name in slots]

    def run(arrays):
        given = {"src": {}, "dst": {}, "edge": {}, "params": {}}
        for (role, name), a in zip(slots, arrays):
            given[role][name] = a
        return prog.vjp(graph=graph, src=given["src"], dst=given["dst"],
                        edge=given["edge"] or None, **fixed, **given["params"])

    return _Program.apply(run, slots, *tensors)


# --------------------------------------------------------------------------- layers
def graph_of(edge_index, num_src, num_dst=None):
    """A Graph for PyG's edge_index (2, E) (row 0 sources, row 1 destinations); edge order
    (for edge_attr) as given. A Graph passes through unchanged."""
    if isinstance(edge_index, Graph):
        return edge_index
    ei = edge_index.detach().cpu().numpy() if isinstance(edge_index, torch.Tensor) else edge_index
    if getattr(ei, "ndim", 0) != 2 or ei.shape[0] != 2:
        raise ValueError(f"edge_index must have shape (2, E), got {tuple(getattr(ei, 'shape', ()))}")
    num_dst = num_src if num_dst is None else num_dst
    return Graph.from_coo(ei[0], ei[1], num_src, num_dst)


def _layer_args(bipartite, names, aliases, x_src, x_dst, edge_attr, params):
    """A layer call's tensors as the core layer takes them: (x, edge_attr, {name: parameter}),
    native arrays, each shared parameter also under its other names."""
    x = (_native(x_src, "x_src"), _native(x_dst, "x_dst")) if bipartite else _native(x_src, "x")
    p = {n: _native(t, n) for n, t in zip(names, params)}
    p.update({alias: p[name] for alias, name in aliases.items()})
    return x, _native(edge_attr, "edge_attr"), p


class _LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core, graph, bipartite, names, aliases, x_src, x_dst, edge_attr, *params):
        x, ea, p = _layer_args(bipartite, names, aliases, x_src, x_dst, edge_attr, params)
        out, backward = core._run(x, graph, ea, p, want_grad=True)
        ctx.backward, ctx.names = backward, names
        result = _tensor(out)
        ctx.save_for_backward(x_src, x_dst, edge_attr, *params, result)   # as in _Attention
        return result

    @staticmethod
    @_first_order_only
    def backward(ctx, dout):
        dx_src, dx_dst, d_ea, dparams = ctx.backward(_native(dout, "dout"))
        return ((None,) * 5 + (_tensor(dx_src), _tensor(dx_dst), _tensor(d_ea))
                + tuple(_tensor(dparams[n]) for n in ctx.names))


class _TorchLayer(torch.nn.Module):
    """A torch.nn.Module around a tiga_numba.layers layer: torch Parameters under PyG's names
    (nested modules, so `state_dict()` has PyG's keys), forward through the fused kernels."""

    _core_class = None

    def __init__(self, *args, **kwargs):
        super().__init__()
        core = self._core_class(*args, **kwargs)
        object.__setattr__(self, "core", core)  # not a torch submodule
        made = {}
        self._names, self._aliases = [], {}  # distinct parameters; other names for them
        for name, array in core.state_dict().items():
            owner, leaf = self, name
            if "." in name:
                mod_name, leaf = name.split(".", 1)
                owner = getattr(self, mod_name, None)
                if owner is None:
                    owner = torch.nn.Module()
                    self.add_module(mod_name, owner)
            key = id(array)  # one array under two names (GATv2 share_weights): one Parameter
            if key in made:
                if "." in name:  # the whole submodule is shared, as in PyG
                    self.add_module(name.split(".", 1)[0], made[key][0])
                self._aliases[name] = made[key][1]
                continue
            owner.register_parameter(leaf, torch.nn.Parameter(torch.from_numpy(array.copy())))
            made[key] = (owner, name)
            self._names.append(name)
        for attr in ("in_channels", "out_channels", "heads", "concat", "edge_dim"):
            setattr(self, attr, getattr(core, attr))
        self._graph_memo = None

    def __getstate__(self):
        # the graph memo holds a weak reference (not picklable) and is only a cache: a pickled or
        # torch.save'd layer starts without it
        state = self.__dict__.copy()
        state["_graph_memo"] = None
        return state

    def _graph(self, edge_index, x):
        if isinstance(edge_index, Graph):
            return edge_index
        bip = isinstance(x, (tuple, list))
        ns = x[0].shape[0] if bip else x.shape[0]
        nd = (x[1].shape[0] if x[1] is not None else ns) if bip else ns
        if not isinstance(edge_index, torch.Tensor):
            return graph_of(edge_index, ns, nd)
        # the Graph of the last edge_index is kept for the next call with the SAME tensor object
        # (a weak reference: a new tensor that happens to get a freed one's address, or another
        # view of the same storage, is not it), unchanged since (its version counter, shared with
        # every view, moves on in-place writes), with the same node counts
        facts = (edge_index._version, edge_index.data_ptr(), tuple(edge_index.shape),
                 tuple(edge_index.stride()), ns, nd)
        memo = self._graph_memo
        if memo is not None and memo[0]() is edge_index and memo[1] == facts:
            return memo[2]
        graph = graph_of(edge_index, ns, nd)
        self._graph_memo = (weakref.ref(edge_index), facts, graph)
        return graph

    def _lookup(self, name):
        # getattr, not get_parameter: torch.func.functional_call swaps in plain tensors
        owner = self
        *path, leaf = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        return getattr(owner, leaf)

    def forward(self, x, edge_index, edge_attr=None, return_attention_weights=None):
        """x: (N, F) or (x_src, x_dst); edge_index: PyG's (2, E) tensor or a tiga_numba.Graph.
        return_attention_weights=True: (out, (edge_index, alpha)) as PyG, computed without
        autograd (under torch.no_grad() or with no input requiring grad; otherwise
        NotImplementedError: no gradient flows through the weights here)."""
        graph = self._graph(edge_index, x)
        self.core.training = self.training
        bip = isinstance(x, (tuple, list))
        x_src, x_dst = (x[0], x[1]) if bip else (x, None)
        params = [self._lookup(n) for n in self._names]
        if return_attention_weights:
            tensors = [t for t in (x_src, x_dst, edge_attr, *params) if isinstance(t, torch.Tensor)]
            if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                raise NotImplementedError(
                    "return_attention_weights=True with autograd: no gradient flows through the "
                    "attention weights here; call the layer under torch.no_grad() for them")
            x, ea, p = _layer_args(bip, self._names, self._aliases, x_src, x_dst, edge_attr, params)
            out, (ei, alpha) = self.core._with_weights(x, graph, ea, p)
            return _tensor(out), (_tensor(ei), _tensor(alpha))
        return _LayerFunction.apply(self.core, graph, bip, self._names, self._aliases, x_src,
                                    x_dst, edge_attr, *params)

    def extra_repr(self):
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads} (tiga_numba fused)"


class GATConv(_TorchLayer):
    """torch.nn.Module twin of PyG's GATConv (same arguments and state_dict)."""
    _core_class = _layers.GATConv


class GATv2Conv(_TorchLayer):
    """torch.nn.Module twin of PyG's GATv2Conv (same arguments and state_dict)."""
    _core_class = _layers.GATv2Conv


class TransformerConv(_TorchLayer):
    """torch.nn.Module twin of PyG's TransformerConv (same arguments and state_dict)."""
    _core_class = _layers.TransformerConv
