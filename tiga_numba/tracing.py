"""Trace `MessagePassing.edge()` once with symbolic stand-ins into a `TracedEdge`.

The trace sees only field names and ranks, param names and the program's reducer/score
network attributes; it never sees data. What it returns is the recognised form: one score
(`symbolic.Score`), one value field, one reducer. Everything else was refused while tracing.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from . import symbolic
from .symbolic import Field, ReducerOutput, Role, _describe, _refuse, as_score

_ACTIVE = threading.local()


def is_score_net(obj):
    """A traced score network (tg.nn.trace(module)) marks itself with __tiga_score_net__."""
    try:
        return getattr(obj, "__tiga_score_net__", False) is True
    except Exception:  # noqa: BLE001 - a hostile __getattr__ is simply "not a net"
        return False


@dataclass
class ReducerCall:
    reducer: object
    score: symbolic.Score
    value: Field


@dataclass
class TracedEdge:
    """The recognised form of one edge() for one call signature."""

    program: str
    score: symbolic.Score
    value: Field
    reducer: object
    reads: set = field(default_factory=set)  # (role, name) read by edge()

    @property
    def kind(self):
        if isinstance(self.score, symbolic.ScoreExpr):
            return "modified"
        return "net" if self.score.net is not None else "attention"

    def reaching_fields(self):
        """(role, name) of every field that reaches the output, in first-use order."""
        seen = []
        for f in self.score.fields() + [self.value]:
            if f.key not in seen:
                seen.append(f.key)
        return seen

    def param_names(self):
        names = set()
        if self.kind == "modified":
            score = self.score
            if score.dot is not None:
                names |= score.dot[2].params()
            for sc in score.scalars.values():
                names |= sc.params()
            return names
        if self.score.net is None:
            names |= self.score.dot_factor.params()
            for _, c in self.score.biases:
                names |= c.params()
        return names

    def describe(self):
        rho = getattr(self.reducer, "block_prune_threshold", None)
        red = "online_softmax()" if rho is None else f"online_softmax(block_prune_threshold={rho})"
        return f"score = {self.score.formula()}; value = {self.value.ref}; reducer = {red}"


class _Recorder:
    def __init__(self):
        self.reads = set()
        self.call = None

    def add(self, key):
        self.reads.add(key)


def record_reduce(reducer, score, value):
    """Called by the reducer object: inside a trace it records the one reduction."""
    rec = getattr(_ACTIVE, "recorder", None)
    if rec is None:
        raise TypeError("an online_softmax reducer is called inside MessagePassing.edge(), which "
                        "tiga_numba traces; on arrays use tg.attention(q, k, v, graph) instead")
    if rec.call is not None:
        _refuse("a second reducer call (a program has exactly one reduction)")
    score = as_score(score, "self.reducer(score, value)")
    if not isinstance(value, symbolic.Product):
        _refuse(f"{_describe(value)} as the reducer's value (the value must be a src field)")
    if not isinstance(value, Field):
        _refuse(f"the value {value.describe()} (the value must be a plain src field; scale the "
                "output after the call instead)")
    if value.role != "src":
        _refuse(f"the {value.role} field {value.ref} as the reducer's value (the value must be a "
                "src field: messages flow from sources to destinations)")
    rec.call = ReducerCall(reducer, score, value)
    return ReducerOutput(rec.call)


def _shadow(program):
    """A copy of the program whose score-network attributes are tracing stand-ins.

    A real instance of the user's class (so isinstance and super() keep working in edge()),
    sharing the attribute values; nets are found by the __tiga_score_net__ marker."""
    cls = type(program)
    shadow = object.__new__(cls)
    attrs = dict(getattr(program, "__dict__", {}))
    for name in dir(cls):
        if name.startswith("__") or name in attrs:
            continue
        value = getattr(cls, name, None)
        if is_score_net(value):
            attrs[name] = value
    for name, value in list(attrs.items()):
        if is_score_net(value):
            attrs[name] = symbolic.NetStandIn(name, value)
    shadow.__dict__.update(attrs)
    return shadow


def trace_edge(program, fields, param_names, head_params=()):
    """Trace `program.edge` with fields {role: {name: ndim}} and symbolic params (those in
    `head_params` are per-head arrays)."""
    rec = _Recorder()
    roles = {r: Role(r, fields.get(r, {}), rec) for r in symbolic.ROLES}
    params = {name: (symbolic.HeadParam(name) if name in head_params else symbolic.param(name))
              for name in param_names}
    shadow = _shadow(program)
    prev = getattr(_ACTIVE, "recorder", None)
    _ACTIVE.recorder = rec
    try:
        result = shadow.edge(roles["src"], roles["dst"], roles["edge"], **params)
    finally:
        _ACTIVE.recorder = prev
    name = type(program).__name__
    if rec.call is None:
        _refuse(f"an edge() that never calls the reducer (returned {_describe(result)}); "
                "edge() must return self.reducer(score, value)")
    if not isinstance(result, ReducerOutput) or result.call is not rec.call:
        _refuse(f"an edge() that returns {_describe(result)} instead of the reducer's output "
                "(return self.reducer(score, value) itself)")
    return TracedEdge(program=name, score=rec.call.score, value=rec.call.value,
                      reducer=rec.call.reducer, reads=rec.reads)
