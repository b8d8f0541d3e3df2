"""Small score networks (`tg.nn`) with numpy/cupy parameters, and `trace` for `edge()`.

These modules hold parameters and can run eagerly on arrays (that is the reference the
tests and the example compare against); inside `MessagePassing.edge()` a traced net is
never run on per-edge data: the GAT lowering (tiga_numba.edge_mlp) reads its layers and
compiles them into a fused per-edge kernel.

Initialisation follows PyTorch's nn.Linear: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)),
drawn from numpy's default_rng(seed) when `seed` is given, else from this module's own
generator (seeded 0 at import, reseed with `manual_seed`), so that runs are repeatable.
Parameters are float32 numpy arrays unless `dtype=` says otherwise; `.to("cuda")` moves
them to cupy.
"""
from __future__ import annotations

import math
import numbers
import operator

import numpy as np

__all__ = ["Module", "Linear", "LeakyReLU", "ReLU", "Tanh", "Sequential", "TracedNet",
           "trace", "manual_seed"]

_GEN = np.random.default_rng(0)


def manual_seed(seed):
    """Reseed the generator used by layers created without an explicit `seed`."""
    global _GEN
    _GEN = np.random.default_rng(seed)


def _xp(array):
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy


def _move(array, device):
    if device == "cpu":
        return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array
    if device == "cuda":
        import cupy
        return cupy.asarray(array)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


class Module:
    """Base: a module has named parameters (arrays) and may hold child modules."""

    def named_parameters(self, prefix=""):
        """[(name, array), ...] of this module's parameters, names prefixed by `prefix`."""
        return []

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def to(self, device):
        """Move parameters to 'cpu' (numpy) or 'cuda' (cupy); returns self."""
        return self

    def __call__(self, x):
        return self.forward(x)


class Linear(Module):
    """y = x @ weight.T + bias; weight (out_features, in_features), bias (out_features,)."""

    def __init__(self, in_features, out_features, seed=None, *, bias=True, dtype=np.float32):
        self.in_features = _positive("in_features", in_features)
        self.out_features = _positive("out_features", out_features)
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        rng = _GEN if seed is None else np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight = rng.uniform(-bound, bound, (self.out_features, self.in_features)).astype(dtype)
        # bias=False keeps an all-zero bias: the kernels then need no special case
        self.bias = (rng.uniform(-bound, bound, self.out_features) if bias
                     else np.zeros(self.out_features)).astype(dtype)

    def named_parameters(self, prefix=""):
        """[(prefix + "weight", weight), (prefix + "bias", bias)]."""
        return [(prefix + "weight", self.weight), (prefix + "bias", self.bias)]

    def to(self, device):
        self.weight = _move(self.weight, device)
        self.bias = _move(self.bias, device)
        return self

    def forward(self, x):
        """x @ weight.T + bias, eagerly on numpy / cupy arrays."""
        return x @ self.weight.T + self.bias

    def __repr__(self):
        return f"Linear(in_features={self.in_features}, out_features={self.out_features})"


class LeakyReLU(Module):
    def __init__(self, negative_slope=0.01):
        if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
            raise TypeError(f"negative_slope must be a real number, got "
                            f"{type(negative_slope).__name__} {negative_slope!r}")
        if not math.isfinite(float(negative_slope)):
            raise ValueError(f"negative_slope must be finite, got {negative_slope}")
        self.negative_slope = float(negative_slope)

    def forward(self, x):
        """x where x > 0, else negative_slope * x."""
        xp = _xp(x)
        return xp.where(x > 0, x, x * self.negative_slope)

    def __repr__(self):
        return f"LeakyReLU(negative_slope={self.negative_slope})"


class ReLU(Module):
    def forward(self, x):
        """max(x, 0)."""
        xp = _xp(x)
        return xp.maximum(x, 0)

    def __repr__(self):
        return "ReLU()"


class Tanh(Module):
    def forward(self, x):
        """tanh(x)."""
        xp = _xp(x)
        return xp.tanh(x)

    def __repr__(self):
        return "Tanh()"


class Sequential(Module):
    """Layers applied in order; indexable and iterable like torch.nn.Sequential."""

    def __init__(self, *layers):
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(f"Sequential layer {i} must be a tiga_numba.nn module, "
                                f"got {type(layer).__name__}")
        self.layers = list(layers)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Sequential(*self.layers[index])
        return self.layers[operator.index(index)]

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def named_parameters(self, prefix=""):
        """The layers' parameters named "<index>.<name>" ("0.weight", "2.bias", ...)."""
        out = []
        for i, layer in enumerate(self.layers):
            out.extend(layer.named_parameters(f"{prefix}{i}."))
        return out

    def to(self, device):
        for layer in self.layers:
            layer.to(device)
        return self

    def forward(self, x):
        """The layers applied in order."""
        for layer in self.layers:
            x = layer(x)
        return x

    def __repr__(self):
        inner = "".join(f"\n  ({i}): {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential({inner}\n)"


def _positive(name, value):
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    return int(v)


# --------------------------------------------------------------------------- tracing
class TracedNet:
    """A score network usable inside `edge()`: `self.attn(a, b, c)` scores each edge with
    module(concat(a, b, c, axis=-1)): one scalar per edge, or one per edge and head when the
    last Linear has H > 1 outputs (then the reducer takes one softmax per head).

    The front end recognises it by `__tiga_score_net__`; the kernels read `layers()`.
    Calling it on concrete arrays runs the module eagerly (materialized; a reference).
    """

    __tiga_score_net__ = True

    def __init__(self, module):
        if isinstance(module, Linear):
            module = Sequential(module)
        if not isinstance(module, Sequential):
            raise TypeError(f"trace expects a tiga_numba.nn.Sequential or Linear, got {type(module).__name__}")
        self.module = module
        self._check()

    def _check(self):
        layers = self.module.layers
        if not layers or not isinstance(layers[0], Linear):
            raise NotImplementedError("score network must start with a Linear layer "
                                      "(its product over the concatenated inputs is split per node)")
        width = layers[0].out_features
        for i, layer in enumerate(layers[1:], 1):
            if isinstance(layer, Linear):
                if layer.in_features != width:
                    raise ValueError(f"layer {i}: in_features={layer.in_features} but the previous "
                                     f"layer gives {width}")
                width = layer.out_features
            elif not isinstance(layer, (LeakyReLU, ReLU, Tanh)):
                raise NotImplementedError(f"layer {i}: {type(layer).__name__} is not supported in a "
                                          "score network (Linear, LeakyReLU, ReLU, Tanh)")
        self._heads = width

    @property
    def out_features(self):
        """Scores per edge: the last Linear's width (1, or H for one softmax per head)."""
        return self._heads

    @property
    def in_features(self):
        return self.module.layers[0].in_features

    def layers(self):
        """The traced network's layers, in order."""
        return list(self.module.layers)

    def named_parameters(self, prefix=""):
        """[("0.weight", array), ("0.bias", array), ("2.weight", ...), ...]"""
        return self.module.named_parameters(prefix)

    def structure(self):
        """Hashable description of the layer stack (the kernel-cache key part)."""
        out = []
        for layer in self.module.layers:
            if isinstance(layer, Linear):
                out.append(("linear", layer.in_features, layer.out_features))
            elif isinstance(layer, LeakyReLU):
                out.append(("leaky_relu", layer.negative_slope))
            elif isinstance(layer, ReLU):
                out.append(("relu",))
            else:
                out.append(("tanh",))
        return tuple(out)

    def __call__(self, *inputs):
        if not inputs:
            raise TypeError("a traced score network needs at least one input")
        xp = _xp(inputs[0])
        x = xp.concatenate([a.reshape(a.shape[0], -1) if a.ndim == 1 else a for a in inputs], axis=-1) \
            if len(inputs) > 1 else inputs[0]
        if x.shape[-1] != self.in_features:
            raise ValueError(f"score network expects {self.in_features} input features, "
                             f"got {x.shape[-1]} after concatenation")
        return self.module(x)

    def __repr__(self):
        return f"TracedNet({self.module!r})"


def trace(module):
    """Wrap a Sequential (or a single Linear) as a per-edge score network for `edge()`."""
    return TracedNet(module)
