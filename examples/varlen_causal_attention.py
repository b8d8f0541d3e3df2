"""Varlen causal attention: compose independent triangular graph blocks.

Graph.cat of per-sequence triangles is the block-diagonal causal relation of flash-attn's
cu_seqlens convention; here it stays implicit (a list of causal blocks, no index arrays) and
runs the same compiled streaming kernel as the dense and triangular relations (no
per-sequence loop, no padding). Graph.cu_seqlens(boundaries, causal=True) builds the same
relation; both are run and must agree bit for bit. The check is per sequence, against the float64 oracle.
"""
import numpy as np

from _common import array_library, check, finish, to_host, to_library

import tiga_numba as tg
from tiga_numba import reference

xp, on_gpu, full = array_library()
heads, width = (4, 64) if full else (2, 16)
lengths = [384, 1, 96, 640, 57]
boundaries = np.cumsum([0, *lengths])  # cu_seqlens
total = sum(lengths)
device = "cuda" if on_gpu else "cpu"
dtype = np.float16 if on_gpu else np.float32

# Block-diagonal causal relation: position i attends j <= i inside its own sequence.
# No edge is added between sequences.
graph = tg.Graph.cat([
    tg.Graph.triangular(length, device=device) for length in lengths
])

generator = np.random.default_rng(20260821)
query = to_library(xp, generator.standard_normal((total, heads, width)).astype(dtype))  # (N, H, D)
key = to_library(xp, generator.standard_normal(query.shape).astype(dtype))
value = to_library(xp, generator.standard_normal(query.shape).astype(dtype))


class VarlenCausalAttention(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        score = (src.key * dst.query).sum(dim=-1) * scale
        return self.reducer(score, src.value)


program = VarlenCausalAttention()
output = program(  # (N, H, D)
    graph=graph,
    src={"key": key, "value": value},
    dst={"query": query},
    scale=width**-0.5,
)

# The flash-attn convention builds the same relation from the cumulative boundaries.
graph_cu = tg.Graph.cu_seqlens(boundaries, causal=True, device=device)
output_cu = program(graph=graph_cu, src={"key": key, "value": value}, dst={"query": query},
                    scale=width**-0.5)


def main():
    print(f"varlen causal attention: lengths={lengths} heads={heads} width={width} "
          f"dtype={np.dtype(dtype)} on {'cupy (GPU)' if on_gpu else 'numpy (CPU)'}")
    print("Graph.cat:        ", graph.explain())
    print("Graph.cu_seqlens: ", graph_cu.explain())
    print(program.explain())
    expected_edges = sum(n * (n + 1) // 2 for n in lengths)
    ok = graph.num_edges == graph_cu.num_edges == expected_edges
    print(f"check edges == sum L(L+1)/2 = {expected_edges}: cat {graph.num_edges}, "
          f"cu_seqlens {graph_cu.num_edges} -> {'OK' if ok else 'FAILED'}")
    same = bool(np.array_equal(to_host(output), to_host(output_cu)))
    print(f"check Graph.cat == Graph.cu_seqlens outputs (bitwise): {'OK' if same else 'FAILED'}")
    ok &= same
    # Oracle per sequence: each sequence is plain causal attention on its own.
    for b, (start, stop) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        seq = slice(int(start), int(stop))
        oracle = reference.attention(query[seq], key[seq], value[seq],
                                     tg.Graph.triangular(int(stop - start)), scale=width**-0.5)
        ok &= check(f"sequence {b} (length {lengths[b]}) vs float64 oracle", output[seq], oracle, dtype)
    finish(ok)


if __name__ == "__main__":
    main()
