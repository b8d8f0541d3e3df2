"""Exact full attention (no mask) as a dense Graph + online-softmax reducer.

cupy on a GPU when present (float16, N = 1024, H = 4, D = 64), numpy on the CPU otherwise
(float32, N = 256, H = 2, D = 32 unless --full).
Prints program.explain() and checks the output against the float64 oracle.
"""
import numpy as np

from _common import array_library, check, dense_oracle, finish, lane_major

import tiga_numba as tg

xp, on_gpu, full = array_library()
gen = np.random.default_rng(0)
nodes, heads, width = (1024, 4, 64) if full else (256, 2, 32)
dtype = np.float16 if on_gpu else np.float32
# the streaming kernel reads any strides: build (H, N, D), view as (N, H, D)
query = lane_major(xp, gen, heads, nodes, width, dtype)
key = lane_major(xp, gen, heads, nodes, width, dtype)
value = lane_major(xp, gen, heads, nodes, width, dtype)


class FullAttention(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        score = (src.key * dst.query).sum(dim=-1) * scale
        return self.reducer(score, src.value)


program = FullAttention()
graph = tg.Graph.dense(nodes, device="cuda" if on_gpu else "cpu")
output = program(  # (N, H, D)
    graph=graph,
    src={"key": key, "value": value},
    dst={"query": query},
    scale=width**-0.5,
)

if __name__ == "__main__":
    print(f"full attention: nodes={nodes} heads={heads} width={width} dtype={np.dtype(dtype)} "
          f"on {'cupy (GPU)' if on_gpu else 'numpy (CPU)'}")
    print(graph.explain())
    print(program.explain())
    # Inspect further: program.ir("llvm"), program.ir("asm") (CPU) / program.ir("ptx") (CUDA)
    oracle, rows = dense_oracle(query, key, value, width**-0.5)
    finish(check(f"full attention vs float64 oracle (rows 0..{rows - 1} of {nodes})",
                 output[:rows], oracle, dtype))
