"""Train a two-layer multi-head GAT (Velickovic et al.: 8 heads x 8, then one head) for node
classification on a synthetic power-law citation-like graph, twice:

  1. with tiga_numba.layers.GATConv and a hand-written Adam on the layers' `vjp` gradients
     (numpy on the CPU, cupy when a GPU is present);
  2. with tiga_numba.torch.GATConv, torch.nn.Modules trained by torch.optim.Adam through the
     fused kernels (skipped with a message when torch is not installed).

Both start from the same weights; the printed losses agree to float32 rounding.

    python examples/gat_training.py [--epochs 20]
"""
from __future__ import annotations

import os
import sys
import time

# numba's kernel threads and a multi-threaded BLAS oversubscribe small machines (measured on
# 2 shared cores: the (N, 64) projections 20x slower); the per-node products here are small.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from _common import array_library, to_library

import numpy as np

import tiga_numba as tg
from tiga_numba.layers import GATConv


# --------------------------------------------------------------------------- the data
def citation_graph(num_nodes=3000, num_classes=5, features=32, cites=4, homophily=0.6, seed=0):
    """Each paper cites `cites` earlier papers, mostly of its own class, chosen with a
    power-law preference (a few papers collect most citations). Messages flow both ways
    along a citation. Features: a noisy class signature."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_nodes)
    popularity = rng.permutation(num_nodes).astype(np.float64) + 1.0
    popularity = popularity ** -1.1  # Zipf-like attractiveness
    src, dst = [], []
    for i in range(1, num_nodes):
        earlier = np.arange(i)
        same = earlier[labels[:i] == labels[i]]
        for _ in range(min(cites, i)):
            pool = same if (same.size and rng.random() < homophily) else earlier
            w = popularity[pool]
            j = pool[np.searchsorted(np.cumsum(w), rng.random() * w.sum())]
            src += [i, j]
            dst += [j, i]
    signature = rng.normal(size=(num_classes, features))
    x = (signature[labels] + 3.0 * rng.normal(size=(num_nodes, features))).astype(np.float32)
    train = rng.random(num_nodes) < 0.3
    return np.array(src), np.array(dst), x, labels, train


def cross_entropy(xp, logits, labels, mask):
    """Mean cross-entropy over the masked nodes, and its gradient w.r.t. the logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = int(mask.sum())
    rows = xp.nonzero(mask)[0]
    loss = -xp.log(p[rows, labels[rows]]).sum() / n
    grad = p
    grad[rows, labels[rows]] -= 1.0
    grad *= mask[:, None] / n
    return float(loss), grad


# --------------------------------------------------------------------------- numpy / cupy
class Adam:
    def __init__(self, params, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=5e-4):
        self.params, self.lr, self.b1, self.b2, self.eps, self.wd = params, lr, *betas, eps, weight_decay
        self.m = {k: 0 * v for k, v in params.items()}
        self.v = {k: 0 * v for k, v in params.items()}
        self.t = 0

    def step(self, grads):
        self.t += 1
        for k, p in self.params.items():
            g = grads[k] + self.wd * p
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
            mh = self.m[k] / (1 - self.b1 ** self.t)
            vh = self.v[k] / (1 - self.b2 ** self.t)
            p -= self.lr * mh / (vh ** 0.5 + self.eps)


def train_numpy(xp, graph, x, labels, train, epochs, num_classes):
    conv1 = GATConv(x.shape[1], 8, heads=8, seed=1)
    conv2 = GATConv(64, num_classes, heads=1, seed=2)
    init = ({k: v.copy() for k, v in conv1.state_dict().items()},
            {k: v.copy() for k, v in conv2.state_dict().items()})
    if xp is not np:
        conv1.to("cuda"), conv2.to("cuda")
    params = {**{f"1.{k}": v for k, v in conv1.state_dict().items()},
              **{f"2.{k}": v for k, v in conv2.state_dict().items()}}
    opt = Adam(params)
    losses = []
    for epoch in range(epochs):
        h, vjp1 = conv1.vjp(x, graph)
        a = xp.where(h > 0, h, xp.expm1(xp.minimum(h, 0)))  # ELU
        logits, vjp2 = conv2.vjp(a, graph)
        loss, dlogits = cross_entropy(xp, logits, labels, train)
        g2 = vjp2(dlogits.astype(np.float32))
        da = g2["x"]
        dh = da * xp.where(h > 0, 1.0, a + 1.0).astype(np.float32)
        g1 = vjp1(dh)
        opt.step({**{f"1.{k}": v for k, v in g1["params"].items()},
                  **{f"2.{k}": v for k, v in g2["params"].items()}})
        losses.append(loss)
    pred = logits.argmax(axis=1)
    acc = float(((pred == labels) & ~train).sum() / (~train).sum())
    return losses, acc, init


def train_torch(src, dst, x, labels, train, epochs, num_classes, init):
    import torch
    import tiga_numba.torch as tgt
    conv1 = tgt.GATConv(x.shape[1], 8, heads=8)
    conv2 = tgt.GATConv(64, num_classes, heads=1)
    conv1.load_state_dict({k: torch.from_numpy(v) for k, v in init[0].items()})
    conv2.load_state_dict({k: torch.from_numpy(v) for k, v in init[1].items()})
    model = torch.nn.ModuleList([conv1, conv2])
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    edge_index = torch.from_numpy(np.stack([src, dst]))
    xt, yt, mt = torch.from_numpy(x), torch.from_numpy(labels), torch.from_numpy(train)
    losses = []
    for epoch in range(epochs):
        opt.zero_grad()
        h = torch.nn.functional.elu(conv1(xt, edge_index))
        logits = conv2(h, edge_index)
        loss = torch.nn.functional.cross_entropy(logits[mt], yt[mt])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv):
    epochs = int(argv[argv.index("--epochs") + 1]) if "--epochs" in argv else 20
    xp, on_gpu, _ = array_library(argv)
    num_classes = 5
    src, dst, x, labels, train = citation_graph(num_classes=num_classes)
    graph = tg.Graph.from_coo(src, dst, x.shape[0], x.shape[0])
    deg = np.bincount(dst, minlength=x.shape[0])
    print(f"graph: {x.shape[0]} papers, {graph.num_edges} directed edges, in-degree max "
          f"{deg.max()} / median {int(np.median(deg))} (power law); backend: "
          f"{'cuda (cupy)' if on_gpu else 'cpu (numpy)'}")
    t0 = time.perf_counter()
    losses, acc, init = train_numpy(xp, graph, to_library(xp, x), to_library(xp, labels),
                                    to_library(xp, train), epochs, num_classes)
    t_np = time.perf_counter() - t0
    for e, loss in enumerate(losses):
        print(f"tiga_numba.layers  epoch {e + 1:3d}  loss {loss:.4f}")
    print(f"tiga_numba.layers: {t_np:.2f} s for {epochs} epochs (first includes compiles), "
          f"held-out accuracy {acc:.3f}")
    ok = losses[-1] < 0.7 * losses[0]
    print("loss decreased:", "OK" if ok else "FAILED")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed: skipping the tiga_numba.torch run")
        return 0 if ok else 1
    t0 = time.perf_counter()
    tl = train_torch(src, dst, x, labels, train, epochs, num_classes, init)
    t_t = time.perf_counter() - t0
    for e, loss in enumerate(tl):
        print(f"tiga_numba.torch   epoch {e + 1:3d}  loss {loss:.4f}")
    diff = max(abs(a - b) for a, b in zip(losses, tl))
    print(f"tiga_numba.torch: {t_t:.2f} s; largest loss difference to the numpy run {diff:.2e}")
    same = diff < 1e-3 * max(1.0, losses[0])
    print("torch adapter follows the numpy run:", "OK" if same else "FAILED")
    return 0 if (ok and same) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
