"""Kernel-source generator for the tensor-core attention kernels (forward, dQ, dK/dV).

Why generate source: numba does not reliably keep small local arrays in registers, so every
fragment register is a named scalar and every loop over fragments is unrolled here in Python.
The text is exec'd twice: against numba.cuda + ptx.py intrinsics (the GPU kernel) and against
emulator.py (a numpy warp emulator that checks layouts, masks and addressing on a CPU).

One generator serves every variant. A `Variant` fixes the compile-time constants (kernel kind,
head dims, dtype, warps, m16 tiles per warp, key-block width); the relation (dense,
triangular, segments, bands) is runtime data: a work table with one row per CTA and its band
limits (see schedule.py), so every block kind and the tails share one body and masking only runs
on the blocks that cross a band edge or the tail.

Layout vocabulary (mma.sync.m16n8k16, per warp; lane = 4 * g + t):
  C fragment (16 x 8, f32):  c{r}, r = 0..3 sits at row g + 8 * (r // 2), column 2 * t + r % 2.
  A fragment (16 x 16, x2):  a0 rows 0-7 / k 0-7, a1 rows 8-15 / k 0-7, a2 rows 0-7 / k 8-15,
                             a3 rows 8-15 / k 8-15 (each u32 holds two neighbouring k).
  B fragment (16 x 8, x2):   b0 k 0-7, b1 k 8-15 (column n = g).
Shared tiles are row-major with 16-byte chunks XOR-swizzled by (row % 8): chunk c of row r
lives at chunk c ^ (r % 8), so ldmatrix's 8 row addresses hit 8 different bank groups.
Register tiles are named "{name}{m}_{j}_{r}" (C: m-tile m, n-tile j) and "{name}{m}_{k}_{r}"
(A: m-tile m, k-step k).

float32 (3xTF32, mma.sync.m16n8k8.tf32; the dtype axis of the same generator):
  A fragment (16 x 8):  a0 (row g, k t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4).
  B fragment (8 x 8):   b0 (k t, n g), b1 (k t + 4, n g).   C as above.
  A k-step covers 8 fp32 = 32 bytes of a row, exactly the bytes of an f16 k16 step, so the
  ldmatrix (b16) addressing of A and of B = K (row-major [n][k]) is byte-for-byte the f16 one:
  lane (g, t) receives the 32-bit word at (row g, word t) of each 8 x 16-byte matrix.
  Every operand is split once into tf32 halves (tf32x2: big = rna(x), small = rna(x - big)),
  registers {name}..._0-3 (big) and _4-7 (small), and each product runs 3 mma passes
  (TF32_PASSES: the small products first, then big * big) with fp32 accumulation.
  C += P B (mma_ab) cannot use ldmatrix.trans (it transposes 16-bit elements), so:
  * key order inside a k-step is permuted: C tile j's (keys 2t, 2t + 1) are the A fragment's
    (k t, k t + 4), i.e. a0..a3 = c0, c2, c1, c3, and B is read at keys 2t (b0), 2t + 1 (b1);
  * output columns are permuted in pairs of n-tiles: column n of tile 2p + e is d = 16p + 2n + e,
    so one 8-byte shared load (lds64) serves the B fragments of both tiles of the pair, and the
    C fragments of the pair hold d = 16p + 4t .. 16p + 4t + 3: one 16-byte store per row
    (store_c_rows). Every mma_ab result is stored through store_c_rows, nothing else reads it.

float32 on wgmma (Variant.split; sm_90a): the 16-bit wgmma kernels on bfloat16 parts. Every tile
is staged as float32 and converted into three bf16 part tiles of the 16-bit layout (stage_tile,
convert_tile), P-like C fragments into three packed A operands (c_to_a_split), and each product
is one wgmma chain over SPLIT_PASSES x k-steps; P B products per Variant.pb_cols-column group into
per-block partials (pb_groups). Outputs are float32 in the natural column order.
"""
from __future__ import annotations

from .backward import delta_grid, gen_delta, gen_dkdv, gen_dq
from .forward import gen_forward
from .modifier import Modifier
from .variant import LOG2E, MASKED, MAX_SMEM, Variant

__all__ = ["Variant", "Modifier", "gen_source", "gen_forward", "gen_dq", "gen_dkdv", "gen_delta", "delta_grid", "LOG2E", "MASKED",
           "MAX_SMEM"]


GENERATORS = {"fwd": gen_forward, "dq": gen_dq, "dkdv": gen_dkdv}


def gen_source(v):
    return GENERATORS[v.kind](v)
