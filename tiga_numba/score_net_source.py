"""The per-edge score-network code both GAT backends generate (tiga_numba.cpu.gat,
tiga_numba.cuda.gat): the compile-time description of a network (`Spec`) and the emitters of
its unrolled per-edge code, the score network living in scalar locals (registers on a GPU):
edge features, weights, the forward score, hoisted row loads, the MLP backward and the routing
of edge-feature gradients. Each emitter returns lines of Python source; the backends wrap them
in their own loops (CPU rows, GPU lane groups)."""
from __future__ import annotations

__all__ = ["Spec", "UNROLL_LIMIT", "unrollable", "layer_widths", "route_edge_grad", "u_features", "u_weights",
           "u_score", "u_hoist", "u_backward", "u_edge_grad", "indented"]


class Spec(tuple):
    """Hashable compile-time description:
    (layers, h1, edge_items, fe, pd, fv)
      layers: tuple after the first Linear: ("linear", in, out, w_off, b_off) |
              ("leaky_relu", slope) | ("relu",) | ("tanh",)
      h1: width of the first Linear
      edge_items: (("disp", off, pd) | ("dist", off) | ("x", off, width, xcol), ...)
      fe: total edge-feature width; pd: position dims; fv: value width
    """

    def __new__(cls, layers, h1, edge_items, fe, pd, fv):
        return super().__new__(cls, (tuple(layers), int(h1), tuple(edge_items), int(fe),
                                     int(pd), int(fv)))

    layers = property(lambda s: s[0])
    h1 = property(lambda s: s[1])
    edge_items = property(lambda s: s[2])
    fe = property(lambda s: s[3])
    pd = property(lambda s: s[4])
    fv = property(lambda s: s[5])


def layer_widths(spec):
    """Output width of every stage: stage 0 = h0, stage k = output of layers[k-1]."""
    w = [spec.h1]
    for layer in spec.layers:
        w.append(layer[2] if layer[0] == "linear" else w[-1])
    return w


def route_edge_grad(spec, side, ge, explicit):
    """Route the edge-feature gradient ge(i) to the positions (side 'dst': minus, 'src':
    plus) and, on the dst side, through explicit(off, width, xcol) to explicit edge features.
    Shared by the looped and the unrolled generators; only how an element is named differs."""
    L = []
    sign = "-" if side == "dst" else "+"
    for it in spec.edge_items:
        if it[0] == "disp":
            for d in range(spec.pd):
                L.append(f"gp{d} {sign}= {ge(it[1] + d)}")
        elif it[0] == "dist":
            L.append("if dist > ZERO:")
            L.append(f"    gd = {ge(it[1])} / dist")
            for d in range(spec.pd):
                L.append(f"    gp{d} {sign}= gd * d{d}")
        elif side == "dst":
            L += explicit(*it[1:])
    return L


# For small networks (the common case: hidden <= 32) every activation, weight and gradient
# of the per-edge network is a scalar local: LLVM keeps them in registers and SLP-vectorises
# the straight-line code; weights are loaded once per chunk, parameter-gradient partials are
# summed in locals and stored once per chunk.
UNROLL_LIMIT = 1200  # weights of layers >= 1 plus edge columns of the first Linear


def unrollable(spec, p_size):
    return p_size + spec.h1 * spec.fe <= UNROLL_LIMIT and max(layer_widths(spec)) <= 64


def u_features(spec, hoisted=None):
    """hoisted="dst": the row's position sits in locals pi<d>; "src": in pj<d>."""
    L = []
    geo = any(it[0] in ("disp", "dist") for it in spec.edge_items)
    if geo:
        for d in range(spec.pd):
            pj = f"pj{d}" if hoisted == "src" else f"pos[j, {d}]"
            pi = f"pi{d}" if hoisted == "dst" else f"pos[i, {d}]"
            L.append(f"d{d} = {pj} - {pi}")
        if any(it[0] == "dist" for it in spec.edge_items):
            L.append("dist = T(math.sqrt(" + " + ".join(f"d{d} * d{d}" for d in range(spec.pd)) + "))")
    for it in spec.edge_items:
        if it[0] == "disp":
            for d in range(spec.pd):
                L.append(f"ef{it[1] + d} = d{d}")
        elif it[0] == "dist":
            L.append(f"ef{it[1]} = dist")
        else:
            _, off, width, xcol = it
            for c in range(width):
                L.append(f"ef{off + c} = EX[e, {xcol + c}]")
    return L


def u_weights(spec):
    """Loads of every weight into locals (once per chunk)."""
    L = []
    for c in range(spec.fe):
        for r in range(spec.h1):
            L.append(f"we{c}_{r} = WeT[{c}, {r}]")
    for layer in spec.layers:
        if layer[0] == "linear":
            _, n_in, n_out, w_off, b_off = layer
            for k in range(n_in * n_out + n_out):
                L.append(f"w{w_off + k} = P[{w_off + k}]")
    return L


def u_score(spec, hoisted=None):
    """hoisted="dst": the row's Ad[i] sits in locals ad<r> (loaded once per row, see
    u_hoist); "src": As[j] in as<r>. None: both read per edge."""
    widths = layer_widths(spec)
    L = []
    for r in range(spec.h1):
        a_s = f"as{r}" if hoisted == "src" else f"As[j, {r}]"
        a_d = f"ad{r}" if hoisted == "dst" else f"Ad[i, {r}]"
        terms = [a_s, a_d] + [f"we{c}_{r} * ef{c}" for c in range(spec.fe)]
        L.append(f"a0_{r} = " + " + ".join(terms))
    for k, layer in enumerate(spec.layers, 1):
        kind = layer[0]
        if kind == "linear":
            _, n_in, n_out, w_off, b_off = layer
            for r in range(n_out):
                terms = [f"w{b_off + r}"] + [f"w{w_off + r * n_in + c} * a{k - 1}_{c}" for c in range(n_in)]
                L.append(f"a{k}_{r} = " + " + ".join(terms))
        else:
            for c in range(widths[k]):
                x = f"a{k - 1}_{c}"
                if kind == "leaky_relu":
                    L.append(f"a{k}_{c} = {x} if {x} > ZERO else {x} * T({layer[1]!r})")
                elif kind == "relu":
                    L.append(f"a{k}_{c} = {x} if {x} > ZERO else ZERO")
                else:
                    L.append(f"a{k}_{c} = T(math.tanh({x}))")
    L.append(f"s = a{len(spec.layers)}_0")
    return L


def u_hoist(spec, side):
    """Per-row loads of the row's own first-layer product and position (the edge loop then
    reads only the neighbour's)."""
    geo = any(it[0] in ("disp", "dist") for it in spec.edge_items)
    if side == "dst":
        return ([f"ad{r} = Ad[i, {r}]" for r in range(spec.h1)]
                + ([f"pi{d} = pos[i, {d}]" for d in range(spec.pd)] if geo else []))
    return ([f"as{r} = As[j, {r}]" for r in range(spec.h1)]
            + ([f"pj{d} = pos[j, {d}]" for d in range(spec.pd)] if geo else []))


def u_backward(spec, param_grads):
    """ds -> g0_r (gradient of h0); param partials into pg<idx> locals."""
    widths = layer_widths(spec)
    K = len(spec.layers)
    L = [f"g{K}_0 = ds"]
    for k in range(K, 0, -1):
        layer = spec.layers[k - 1]
        kind = layer[0]
        if kind == "linear":
            _, n_in, n_out, w_off, b_off = layer
            for c in range(n_in):
                terms = [f"w{w_off + r * n_in + c} * g{k}_{r}" for r in range(n_out)]
                L.append(f"g{k - 1}_{c} = " + " + ".join(terms))
            if param_grads:
                for r in range(n_out):
                    L.append(f"pg{b_off + r} += g{k}_{r}")
                    for c in range(n_in):
                        L.append(f"pg{w_off + r * n_in + c} += g{k}_{r} * a{k - 1}_{c}")
        else:
            for c in range(widths[k]):
                g = f"g{k}_{c}"
                if kind == "leaky_relu":
                    L.append(f"g{k - 1}_{c} = {g} if a{k - 1}_{c} > ZERO else {g} * T({layer[1]!r})")
                elif kind == "relu":
                    L.append(f"g{k - 1}_{c} = {g} if a{k - 1}_{c} > ZERO else ZERO")
                else:
                    L.append(f"g{k - 1}_{c} = {g} * (ONE - a{k}_{c} * a{k}_{c})")
    return L


def u_edge_grad(spec, side):
    """gef = We^T gh0 into scalars ge<c>, then routed (unrolled generator)."""
    if not spec.fe:
        return []
    L = [f"ge{c} = " + " + ".join(f"we{c}_{r} * g0_{r}" for r in range(spec.h1))
         for c in range(spec.fe)]
    L += route_edge_grad(spec, side, lambda i: f"ge{i}",
                          lambda off, width, xcol: [f"dEX[e, {xcol + c}] = ge{off + c}"
                                                    for c in range(width)])
    return L


def indented(lines, n):
    return "\n".join(" " * n + x for x in lines)
