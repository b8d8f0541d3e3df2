"""A causal reducer expressed as a triangular Graph, not a core NN operator.

The edge function has no mask code;
Graph.triangular(n) holds exactly the edges j <= i and stays implicit (no index arrays).
cupy on a GPU when present (float16), numpy on the CPU otherwise (float32).
"""
import numpy as np

from _common import array_library, check, finish, lane_major

import tiga_numba as tg
from tiga_numba import reference

xp, on_gpu, full = array_library()
gen = np.random.default_rng(7)
nodes, heads, width = 256, 2, 64  # small enough for CI on a CPU
dtype = np.float16 if on_gpu else np.float32
# the streaming kernel reads any strides: (H, N, D) viewed as (N, H, D)
query = lane_major(xp, gen, heads, nodes, width, dtype)
key = lane_major(xp, gen, heads, nodes, width, dtype)
value = lane_major(xp, gen, heads, nodes, width, dtype)


class CausalWeightedValue(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        score = (src.key * dst.query).sum(dim=-1) * scale
        return self.reducer(score, src.value)


graph = tg.Graph.triangular(nodes, device="cuda" if on_gpu else "cpu")
kernel = CausalWeightedValue()
output = kernel(  # (N, H, D)
    graph=graph,
    src={"key": key, "value": value},
    dst={"query": query},
    scale=width**-0.5,
)


def main():
    print(f"causal attention: nodes={nodes} heads={heads} width={width} dtype={np.dtype(dtype)} "
          f"on {'cupy (GPU)' if on_gpu else 'numpy (CPU)'}")
    print(graph.explain())  # triangular, edges = N(N+1)/2
    print(kernel.explain())
    ok = graph.num_edges == nodes * (nodes + 1) // 2
    print(f"check edges == N(N+1)/2: {graph.num_edges} -> {'OK' if ok else 'FAILED'}")
    oracle = reference.attention(query, key, value, graph, scale=width**-0.5)
    ok &= check("causal attention vs float64 oracle", output, oracle, dtype)
    # The first row sees only itself: its output is its own value, whatever the scores.
    ok &= check("row 0 == value[0]", output[:1], np.asarray(
        value[:1].get() if on_gpu else value[:1], dtype=np.float64), dtype)
    finish(ok)


if __name__ == "__main__":
    main()
