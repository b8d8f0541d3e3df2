"""Sliding-window attention with a tanh soft-cap (Gemma-2 / Mistral style), flash-attn's way.

Graph.band(n, left=W - 1) is flash-attn's window_size=(W - 1, 0): query i attends keys
i - W + 1 .. i. It stays implicit (no index arrays) and the kernels visit only the key tiles
inside the band. softcap= is flash-attn's soft-cap, compiled into the kernels
(f = cap * tanh(s / cap)); gradients flow through it. A chunked prefill against a KV cache is the
same band on rectangular blocks: Graph.cu_seqlens(cu_q, cu_seqlens_k=cu_k, window=(W - 1, 0))
aligns each chunk's queries bottom-right with its keys. Checked against float64 oracles.
"""
import numpy as np

from _common import array_library, check, finish, to_host, to_library

import tiga_numba as tg
from tiga_numba import reference

xp, on_gpu, full = array_library()
heads, kv_heads, width = (8, 2, 64) if full else (4, 2, 16)
n, window, cap = (2048, 256, 30.0) if full else (300, 48, 5.0)
device = "cuda" if on_gpu else "cpu"
dtype = np.float16 if on_gpu else np.float32
scale = width ** -0.5

generator = np.random.default_rng(20261202)
host = {name: generator.standard_normal(shape).astype(dtype) for name, shape in
        (("q", (n, heads, width)), ("k", (n, kv_heads, width)), ("v", (n, kv_heads, width)),
         ("dout", (n, heads, width)))}
q, k, v, dout = (to_library(xp, host[name]) for name in ("q", "k", "v", "dout"))

graph = tg.Graph.band(n, left=window - 1, device=device)      # window_size = (W - 1, 0)
out, stats = tg.attention(q, k, v, graph, softcap=cap, return_stats=True)
forward_plan = tg.explain()
dq, dk, dv = tg.attention_backward(dout, q, k, v, out, stats, graph, softcap=cap)

# chunked prefill: 3 sequences whose last `chunk` queries see their whole (cached) key range
chunk, cached = 40, [120, 0, 75]
cu_k = np.cumsum([0] + [c + chunk for c in cached])
cu_q = np.cumsum([0] + [chunk] * len(cached))
prefill = tg.Graph.cu_seqlens(cu_q, cu_seqlens_k=cu_k, window=(window - 1, 0), device=device)
pq = to_library(xp, generator.standard_normal((int(cu_q[-1]), heads, width)).astype(dtype))
pk = to_library(xp, generator.standard_normal((int(cu_k[-1]), kv_heads, width)).astype(dtype))
pv = to_library(xp, generator.standard_normal((int(cu_k[-1]), kv_heads, width)).astype(dtype))
prefill_out = tg.attention(pq, pk, pv, prefill)


def softcap_oracle(q, k, v, dout, graph, cap, scale):
    """float64: every edge of the relation as a dense mask, scores soft-capped, softmax; returns
    out and (dq, dk, dv), with dS = P (dP - Delta) (1 - tanh(z / cap)^2) for z = scale q.k."""
    q, k, v, dout = (to_host(a).astype(np.float64) for a in (q, k, v, dout))
    mask = graph.to_scipy().toarray() != 0
    group = q.shape[1] // k.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group], v[:, h // group]
        t = np.tanh(q[:, h] @ kh.T * scale / cap)
        y = np.where(mask, cap * t, -np.inf)
        p = np.exp(y - y.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        out[:, h] = p @ vh
        dp = dout[:, h] @ vh.T
        dz = p * (dp - (dout[:, h] * out[:, h]).sum(1, keepdims=True)) * (1 - t * t)
        dq[:, h] = dz @ kh * scale
        dk[:, h // group] += dz.T @ q[:, h] * scale
        dv[:, h // group] += p.T @ dout[:, h]
    return out, (dq, dk, dv)


def main():
    print(f"sliding window W={window} with soft-cap {cap}: n={n} heads={heads}/{kv_heads} width={width} "
          f"dtype={np.dtype(dtype)} on {'cupy (GPU)' if on_gpu else 'numpy (CPU)'}")
    print(f"program: tg.attention(q, k, v, Graph.band(n, left={window - 1}), softcap={cap})")
    print(forward_plan)
    expected = sum(min(i + 1, window) for i in range(n))
    ok = graph.num_edges == expected
    print(f"check edges == sum min(i + 1, W) = {expected}: {graph.num_edges} -> {'OK' if ok else 'FAILED'}")
    want_out, want_grads = softcap_oracle(host["q"], host["k"], host["v"], host["dout"], graph, cap, scale)
    ok &= check("soft-capped window forward vs float64 oracle", out, want_out, dtype)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads):
        ok &= check(f"soft-capped window backward {name} vs float64 oracle", got, ref, dtype)
    print("chunked prefill:", prefill.explain())
    ok &= check("chunked prefill (bottom-right window) vs float64 oracle", prefill_out,
                reference.attention(pq, pk, pv, prefill), dtype)
    finish(ok)


if __name__ == "__main__":
    main()
