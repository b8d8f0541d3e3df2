"""GAT-style edge attention: an nn scores each edge, online softmax combines.

    s_e   = MLP(pos_j - pos_i || x_j || x_i)          one scalar per edge e = (j -> i)
    out_i = sum_e softmax_{e into i}(s)_e * x_j

The score network runs inside a row-centric fused kernel (numba parallel on the CPU; on the
GPU a group of lanes per row, each lane scoring its own edges): the first Linear is split
into per-node products (W_src x_j, W_dst x_i + b, once per node), the displacement part and
the rest of the MLP run per edge in registers, and the online softmax keeps (m, l) per
destination row. No (E, .) score, weight, hidden or displacement array is materialized, in
the forward or in the fused backward (program.vjp).

Runs on numpy (CPU) by default; with TIGA_GAT_CUPY=1 and a GPU the same program runs on cupy
arrays through the numba.cuda kernels (docs/gat.md).
"""
import os
import sys

import numpy as np

import _common  # noqa: F401  (finds the package in a checkout without an install)
import tiga_numba as tg
import tiga_numba.nn as nn  # submodule import; `tg.nn` works once it is imported

xp = np
if os.environ.get("TIGA_GAT_CUPY") == "1" and not os.environ.get("TIGA_EXAMPLES_CPU"):
    import cupy as xp  # noqa: F811

rng = np.random.default_rng(0)
nodes, f_in, hidden = 512, 8, 16
positions = xp.asarray(rng.random((nodes, 3)).astype(np.float32))        # (N, 3)
x = xp.asarray(rng.standard_normal((nodes, f_in)).astype(np.float32))   # (N, F_in)


class GAT(tg.MessagePassing):
    reducer = tg.online_softmax()      # attention: softmax over incoming edges

    def __init__(self, attn):
        super().__init__()
        self.attn = nn.trace(attn)     # scalar score network, per edge

    def edge(self, src, dst, edge):
        # s_e = attn([pos_src - pos_dst || x_src || x_dst])   (E, 1)
        # out_i = sum_e softmax_e(s) * x_src(e)               (N, F_in)
        return self.reducer(self.attn(edge.displacement, src.x, dst.x), src.x)


graph = tg.Graph.radius(positions, cutoff=0.15)  # avg degree ~ 7
attn = nn.Sequential(
    nn.Linear(3 + 2 * f_in, hidden, seed=0), nn.LeakyReLU(0.2), nn.Linear(hidden, 1, seed=1),
)
if xp is not np:
    attn.to("cuda")
kernel = GAT(attn)

output = kernel(graph=graph, src={"x": x}, dst={"x": x})  # (N, F_in)


# ---------------------------------------------------------------- float64 oracle (materialized)
def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def oracle_forward(graph, attn, positions, x):
    rel = graph.realize("cpu")
    dst = np.repeat(np.arange(graph.num_dst), np.diff(rel.indptr))
    src = rel.indices.astype(np.int64)
    pos, xx = to_host(positions).astype(np.float64), to_host(x).astype(np.float64)
    h = np.concatenate([pos[src] - pos[dst], xx[src], xx[dst]], axis=1)
    w1, b1 = to_host(attn[0].weight).astype(np.float64), to_host(attn[0].bias).astype(np.float64)
    w2, b2 = to_host(attn[2].weight).astype(np.float64), to_host(attn[2].bias).astype(np.float64)
    a = h @ w1.T + b1
    s = (np.where(a > 0, a, 0.2 * a) @ w2.T + b2)[:, 0]
    m = np.full(graph.num_dst, -np.inf)
    np.maximum.at(m, dst, s)
    p = np.exp(s - m[dst])
    l = np.zeros(graph.num_dst)
    np.add.at(l, dst, p)
    out = np.zeros((graph.num_dst, xx.shape[1]))
    np.add.at(out, dst, (p / l[dst])[:, None] * xx[src])
    return out


ok = True
ref = oracle_forward(graph, attn, positions, x)
err = float(np.max(np.abs(to_host(output) - ref)))
print(f"graph: {graph.explain()}")
print(f"forward vs float64 oracle: max abs err {err:.2e}", "OK" if err < 1e-4 else "FAILED")
ok &= err < 1e-4

# ---------------------------------------------------------------- one training step (SGD)
# Training is fused as well: the forward persists only the per-row softmax state (m, l);
# the backward replays the score chain per row and streams gradients to the fields, the
# positions and the score-network weights.
target = xp.asarray(rng.standard_normal((nodes, f_in)).astype(np.float32))


def loss_of(out):
    return 0.5 * float(((out - target) ** 2).sum())


out, vjp = kernel.vjp(graph=graph, src={"x": x}, dst={"x": x})
loss0 = loss_of(out)
grads = vjp(out - target)          # d loss / d out
gsq = sum(float((grads["params"][f"attn.{name}"] ** 2).sum()) for name, _ in attn.named_parameters())
lr = 1e-3 / np.sqrt(gsq)           # a small normalised step: first-order prediction holds
for name, p in attn.named_parameters():
    p -= lr * grads["params"][f"attn.{name}"]   # in place: the traced net sees the update
print(f"grads: params {sorted(grads['params'])}, positions {tuple(grads['positions'].shape)}, "
      f"src.x {tuple(grads['src']['x'].shape)}, dst.x {tuple(grads['dst']['x'].shape)}")
loss1 = loss_of(kernel(graph=graph, src={"x": x}, dst={"x": x}))
predicted = lr * gsq               # first-order decrease along -grad
ratio = (loss0 - loss1) / predicted
good = loss1 < loss0 and 0.8 < ratio < 1.2
print(f"training step (SGD on attn): loss {loss0:.4f} -> {loss1:.4f}; actual/predicted decrease "
      f"{ratio:.3f}", "OK" if good else "FAILED")
ok &= good

print()
print(kernel.explain())
print()
print("all checks passed" if ok else "FAILED")
sys.exit(0 if ok else 1)
