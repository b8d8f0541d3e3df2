"""Kernel-source generator for the tensor-core attention kernels (forward, dQ, dK/dV).

Why generate source: numba does not reliably keep small local arrays in registers, so every
fragment register is a named scalar and every loop over fragments is unrolled here in Python.
The text is exec'd twice: against numba.cuda + ptx.py intrinsics (the GPU kernel) and against
emulator.py (a numpy warp emulator that checks layouts, masks and addressing on a CPU).

One generator serves every variant. A `Variant` fixes the compile-time constants (kernel kind,
head dims, dtype, warps, m16 tiles per warp, key-block width); the relation (dense,
triangular, segments) is runtime data: a work table with one row per CTA (see schedule.py), so
causal/non-causal and tails share one body and masking only runs on tiles that need it.

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

from dataclasses import dataclass

LOG2E = 1.4426950408889634
#: raw score given to masked (non-)edges: finite, so fast-math cannot fold it, and far below
#: any real score so exp2 of (masked * scale - max) underflows to 0
MASKED = -1.0e30

#: shared memory a CTA may use on sm_90 (227 KB); above 48 KB it is dynamic
MAX_SMEM = 227 * 1024

#: work-table row: int32 fields, one row per CTA (schedule.py writes them)
WORK_FIELDS = ("row0", "rows", "col0", "cols", "diag", "causal")

#: wgmma's 128-byte swizzle is a function of the absolute shared address (bits 4-6 ^= bits 7-9),
#: so wgmma kernels start their tiles on a 1024-byte boundary (and allocate that much slack)
WG_ALIGN = 1024

#: the 3xTF32 passes (A half, B half) in issue order: small products first, big * big last, so
#: the small terms are not lost against the large partial sum. One pass (("big", "big"),) is
#: plain TF32 (~1e-3 relative error): the tests use it to show the tolerances catch it.
TF32_PASSES = (("big", "small"), ("small", "big"), ("big", "big"))

#: float32 on wgmma (Variant.split): every operand x is held as three bfloat16 parts, x = hi + mid
#: + lo + O(2^-24 |x|) (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid): bfloat16 has
#: float32's exponent range, so no scaling is needed). A product sums SPLIT_PASSES part products
#: (A part, B part), smallest first; the dropped ones (mid lo, lo mid, lo lo) are ~2^-24 of it:
#: fp32-class, like 3xTF32, at 6 bf16 passes (bf16 wgmma runs at twice tf32's rate).
SPLIT_PARTS = ("hi", "mid", "lo")
SPLIT_PASSES = (("lo", "hi"), ("hi", "lo"), ("mid", "mid"), ("mid", "hi"), ("hi", "mid"), ("hi", "hi"))
#: split P B products accumulate each streamed block in fresh partial tiles, added to the
#: accumulator in ordinary fp32 (PB_PAIRS's reason, measured for wgmma too: results file
#: fp32-wgmma-h200-2026-11-30.txt); False feeds the accumulator into the chain
SPLIT_PARTIALS = True

#: tf32 mma_pb accumulates each streamed block into fresh partial C tiles, PB_PAIRS n-tile pairs
#: at a time, and adds them to the running accumulator with an ordinary (round-to-nearest) fp32
#: add. Why: the tensor cores' fp32 accumulation truncates (measured on the H200: with O, dQ, dK,
#: dV fed back into the mma across all blocks, the relative error grew with N, 3e-5 at 4096 and
#: 1e-4 at 16384 keys); fresh partials cap the truncated sum at one block (BN/8 k-steps x 3).
#: None: the accumulator is fed back into the mma (plain TF32 error budget; the tests use it).
PB_PAIRS = 2


@dataclass(frozen=True)
class Variant:
    kind: str          # "fwd" | "dq" | "dkdv"
    D: int             # q/k head dim
    Dv: int            # v head dim
    dtype: str = "float16"
    NW: int = 4        # warps per CTA
    MT: int = 1        # m16 tiles per warp: a CTA owns BM = 16 * MT * NW rows
    BN: int = 64       # width of the streamed block (keys for fwd/dq, queries for dkdv)
    a_smem: bool = False  # resident operand (Q / K,V) stays in shared memory, A fragments loaded
    #                       at use: frees registers for MT = 2 at D = 128
    fuse_dq: bool = False  # dkdv only: also computes dQ (5 products instead of 7, see gen_dkdv)
    dq_atomic: bool = False  # with fuse_dq: add dQ blocks with float atomics (red.global.add), in
    #                          no fixed order: NOT deterministic, an experiment / opt-in only
    wgmma: bool = False  # sm_90a warpgroup products (see "wgmma" below): each group of 4 warps
    #                      multiplies its 64 rows at once, operands straight from shared memory
    prune: bool = False  # fwd only: tile-pruning admission (docs/design.md), see prune_gate
    pb_cols: int = 64    # split: output columns per P B chain and its per-block partial (pb_groups);
    #                      fewer columns, fewer partial registers
    overlap: bool = True  # wgmma backward: the dP chain (and, 16-bit dK/dV, the dV chain) is issued
    #                       without waiting and runs while the CUDA cores make P (dS); False: every
    #                       chain waits at once (the A/B baseline of bench_tc_bwd.py)

    @property
    def wg_async(self):
        """the wgmma backward overlaps chains with CUDA-core work (overlap)."""
        return self.wgmma and self.overlap

    @property
    def NT(self):
        return 32 * self.NW

    @property
    def BM(self):
        return 16 * self.MT * self.NW

    @property
    def tf32(self):
        """float32 inputs on mma.sync run as 3xTF32 on mma.m16n8k8 (module docstring)."""
        return self.dtype == "float32" and not self.wgmma

    @property
    def split(self):
        """float32 inputs on wgmma run as bf16 x 3 splits, SPLIT_PASSES per product ("wgmma" below)."""
        return self.dtype == "float32" and self.wgmma

    @property
    def EB(self):
        """bytes per element in the shared-memory operand tiles (split: bfloat16 parts)."""
        return 4 if self.tf32 else 2

    @property
    def GB(self):
        """bytes per element of the kernel's global inputs and outputs (q's dtype)."""
        return 4 if self.dtype == "float32" else 2

    @property
    def parts(self):
        """operand tiles per matrix in shared memory: split = (hi, mid, lo), else the tile itself."""
        return len(SPLIT_PARTS) if self.split else 1

    @property
    def stream_buffers(self):
        """streamed blocks in shared memory at once: 2 (cp.async double buffer), or for split 1
        (the next block lands in the float32 staging tile instead, see StreamedPair)."""
        return 1 if self.split else 2

    def ksteps(self, width):
        """k-steps of a product whose k dimension is `width` elements (k16 for 16-bit, k8 for tf32):
        32 bytes of a row each."""
        return width * self.EB // 32

    def check(self):
        for d in (self.D, self.Dv):
            # the XOR swizzle permutes chunks within groups of 8 (128 bytes): a row must hold whole
            # groups; wgmma tiles pad each row to whole 128-byte sub-tile rows (row_bytes), so
            # multiples of 32 work there when the intrinsics cover the shapes (checked below)
            if self.wgmma and (d % 32 or d < 32):
                raise ValueError(f"wgmma: head dim must be a multiple of 32, got {d}")
            if not self.wgmma and (d % 64 or d < 64):
                raise ValueError(f"head dim must be a multiple of 64 (128-byte swizzle groups), got {d}")
        if self.BN % 16 or self.BN < 16:
            raise ValueError(f"BN must be a multiple of 16, got {self.BN}")
        if self.kind not in ("fwd", "dq", "dkdv"):
            raise ValueError(f"unknown kernel kind {self.kind!r}")
        if self.prune and (self.kind != "fwd" or self.NW % 4):
            raise ValueError("tile pruning is a forward option and reads the warps' maxima four at a "
                             "time (NW % 4 == 0)")
        if self.dq_atomic and not self.fuse_dq:
            raise ValueError("dq_atomic needs fuse_dq")
        if self.fuse_dq:
            if self.kind != "dkdv":
                raise ValueError("fuse_dq is a dK/dV kernel option")
            if self.BM * self.EB % 128:
                raise ValueError(f"fuse_dq: a dS row of BM = {self.BM} keys must hold whole 128-byte swizzle groups")
            if self.wgmma:
                self.wg_dq_units()
            else:
                self.dq_warps()
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {self.dtype!r}")
        if self.wgmma:
            if self.MT != 1 or self.NW % 4 or not self.a_smem:
                raise ValueError("wgmma: warpgroups of 4 warps with 16 rows each (NW % 4 == 0, MT = 1), "
                                 "resident operands in shared memory (a_smem)")
            if self.fuse_dq and self.split:
                raise ValueError("wgmma fuse_dq: 16-bit only (float32 would need dS in three bf16 parts)")
            from .ptx import WGMMA_N
            # products: S-like (N = BN, or the keys of dK/dV's S^T) and P B-like (N = D or Dv; split:
            # per pb_cols-column group)
            for n in [self.BN] + [n for w in (self.D, self.Dv) for n in pb_groups(self, w)]:
                if n not in WGMMA_N:
                    raise ValueError(f"wgmma: no m64n{n}k16 product (ptx.WGMMA_N {WGMMA_N})")
            for w in (self.D, self.Dv):   # whole copy passes: stage_tile's (split) or load_tile's
                if self.split and any((rows * w // 4) % self.NT for rows in (self.BN, self.BM)):
                    raise ValueError(f"split: {self.NT} threads cannot stage float32 tiles of width {w} "
                                     f"({self.BN} and {self.BM} rows) in whole 16-byte passes")
                if not self.split and self.NT % (self.row_bytes(w) // 16):
                    raise ValueError(f"wgmma: {self.NT} threads cannot load {self.row_bytes(w)}-byte padded rows "
                                     "in whole passes")
        if self.smem_bytes() > MAX_SMEM:
            raise ValueError(f"{self} needs {self.smem_bytes()} B of shared memory (> {MAX_SMEM})")
        return self

    def row_bytes(self, width):
        """shared bytes per row of a (rows x width) tile: width elements, or (wgmma) whole 128-byte
        sub-tile rows, the tail of the last one unused (D = 96: 192 bytes of data in 256)."""
        nb = width * self.EB
        return -(-nb // 128) * 128 if self.wgmma else nb

    def prune_bytes(self):
        """pruning: the warps' tile maxima (one float each), read back in 16-byte loads."""
        return 4 * self.NW if self.prune else 0

    @property
    def dynamic_smem(self):
        """above 48 KB a CTA's shared memory must be dynamic (and the kernel's limit raised)."""
        return self.smem_bytes() > 48 * 1024

    def stream_tile_bytes(self):
        """one streamed block (all parts)."""
        return self.parts * self.BN * (self.row_bytes(self.D) + self.row_bytes(self.Dv))

    def staging_bytes(self):
        """split: the float32 staging tile (cp.async lands there, stage_tile / convert_tile), large
        enough for a streamed block and for each resident tile."""
        if not self.split:
            return 0
        return 4 * max(self.BN * (self.D + self.Dv), self.BM * max(self.resident_widths()))

    def staging_offset(self):
        """split: where the staging tile starts (after the resident and streamed tiles)."""
        return self.resident_bytes() + self.stream_buffers * self.stream_tile_bytes()

    def resident_widths(self):
        """head widths of the CTA's own row tiles: Q (fwd), Q and dO (dq), K and V (dkdv)."""
        return (self.D,) if self.kind == "fwd" else (self.D, self.Dv)

    def kept_in_shared(self):
        """which resident tiles (by position) stay in shared memory for the whole kernel: all of them
        with a_smem; K for the fused dQ product (its B operand) even when its A fragments are in registers."""
        n = len(self.resident_widths())
        return tuple(i for i in range(n) if self.a_smem or (self.fuse_dq and i == 0))

    def resident_bytes(self):
        """shared bytes held for the whole kernel by the resident tiles kept in shared memory."""
        w = self.resident_widths()
        return self.parts * self.BM * sum(self.row_bytes(w[i]) for i in self.kept_in_shared())

    def ds_tile_bytes(self):
        """fused dQ: the block's dS, query-major (BN rows of BM keys)."""
        return self.BN * self.BM * self.EB if self.fuse_dq else 0

    def dq_stage_row(self):
        """bytes per row of the fused dQ staging tiles (float32, natural column order), padded so
        the C-fragment stores are bank-conflict-free (8 words: 16-bit pairs, 16 words: tf32 quads)."""
        return 4 * self.D + (64 if self.tf32 else 32)

    def dq_stage_bytes(self):
        """fused dQ: two float32 BN x D tiles, this block's dQ and the fetched running sum."""
        return 2 * self.BN * self.dq_stage_row() if self.fuse_dq and not self.dq_atomic else 0

    def smem_bytes(self):
        w = self.resident_widths()
        staged = [w[i] for i in range(len(w)) if i not in self.kept_in_shared()]
        staging = self.BM * max(self.row_bytes(x) for x in staged) if staged else 0   # register mode: staged once
        return (self.resident_bytes() + max(self.stream_buffers * self.stream_tile_bytes(), staging)
                + self.staging_bytes() + self.ds_tile_bytes() + self.dq_stage_bytes()
                + (WG_ALIGN if self.wgmma else 0) + self.prune_bytes())

    def dq_warps(self):
        """warp grid of the fused dQ product (BN queries x D columns over BM keys): WR row groups of
        MQ m16 tiles times WC column groups of NQ n-tile pairs. A column group is whole 128-byte
        swizzle groups (64 16-bit / 32 fp32 columns), so its B offsets are the precomputed ones plus
        a multiple of 128 bytes."""
        import math
        WR = math.gcd(self.NW, self.BN // 16)
        WC = self.NW // WR
        group = 128 // self.EB
        if self.BN % 16 or self.D % (WC * group):
            raise ValueError(f"fuse_dq: {self.NW} warps cannot split a {self.BN} x {self.D} dQ block "
                             f"into m16 row tiles and {group}-column groups")
        if self.NT % (self.D // 4) or (self.BN * self.D // 4) % self.NT:
            raise ValueError(f"fuse_dq: {self.NT} threads cannot move a {self.BN} x {self.D} float32 dQ block "
                             "in whole 16-byte passes")
        return WR, WC, self.BN // 16 // WR, self.D // WC // 16

    def wg_dq_units(self):
        """fused dQ on wgmma: the block's BN x D dQ as units of 64 query rows x N columns, one wgmma
        chain each (A = dS rows from shared memory, B = the resident K tile), dealt round-robin to
        the warpgroups. Returns (row groups RG, column groups CG, N, units per warpgroup); the
        ordered accumulation also moves whole float32 rows in 16-byte passes (dq_passes)."""
        from .ptx import WGMMA_N
        nwg, RG = self.NW // 4, self.BN // 64
        CG = max(1, nwg // max(RG, 1))
        N = self.D // CG
        if self.BN % 64 or (RG * CG) % nwg or self.D % CG or N not in WGMMA_N or (CG > 1 and N % 64 and 64 % N):
            raise ValueError(f"wgmma fuse_dq: {nwg} warpgroups cannot split a {self.BN} x {self.D} dQ block into "
                             "units of 64 query rows and whole m64nN column groups")
        if not self.dq_atomic and (self.NT % (self.D // 4) or (self.BN * self.D // 4) % self.NT):
            raise ValueError(f"fuse_dq: {self.NT} threads cannot move a {self.BN} x {self.D} float32 dQ block "
                             "in whole 16-byte passes")
        return RG, CG, N, RG * CG // nwg

    def name(self):
        return (f"tc_{self.kind}_{self.dtype}_d{self.D}_dv{self.Dv}_nw{self.NW}_mt{self.MT}_bn{self.BN}"
                + (f"_pc{self.pb_cols}" if self.split and self.pb_cols != 64 else "")
                + ("_as" if self.a_smem else "") + ("_fq" if self.fuse_dq else "") + ("_at" if self.dq_atomic else "")
                + ("_wg" if self.wgmma else "") + ("_so" if self.wgmma and not self.overlap else "")
                + ("_pr" if self.prune else ""))


# ----------------------------------------------------------------------------- source writer
class Source:
    """the kernel text: `def kernel` and, before it, the module-level lines that make the wgmma
    intrinsics it calls (chain(), wait())."""

    def __init__(self):
        self.lines, self.ind, self.prelude, self.made = [], 0, [], {}

    def chain(self, form, N, steps, wait=True):
        """the name of a wgmma chain intrinsic (ptx.wgmma_chain(form, N, steps[, wait])), made once per text."""
        return self._made(f"wgmma_chain({form!r}, {N}, {tuple(steps)!r}" + ("" if wait else ", False") + ")")

    def wait(self, n, count):
        """the name of ptx.wgmma_wait(n, count), made once per text."""
        return self._made(f"wgmma_wait({n}, {count})")

    def _made(self, ctor):
        """the name bound to the intrinsic `ctor` (a ptx call) in the prelude, made once per text."""
        if ctor not in self.made:
            self.made[ctor] = name = f"wgc{len(self.made)}"
            self.prelude.append(f"{name} = {ctor}")
        return self.made[ctor]

    def __call__(self, s):
        self.lines.append("    " * self.ind + s)

    def indent(self):
        src = self

        class _Ctx:
            def __enter__(self):
                src.ind += 1

            def __exit__(self, *a):
                src.ind -= 1
        return _Ctx()

    def text(self):
        return "\n".join(self.prelude + self.lines) + "\n"


def udiv(a, b):
    """a // b on non-negative values below 2^32 (head and block indices) as a 32-bit division:
    a 64-bit one is a subroutine call in SASS, which also makes ptxas serialise wgmma."""
    return f"i64(u32({a}) // u32({b}))"


def umod(a, b):
    return f"i64(u32({a}) % u32({b}))"


def _tree(op, xs):
    """balanced reduction expression (short dependency chains)"""
    xs = list(xs)
    while len(xs) > 1:
        nxt = [op(xs[i], xs[i + 1]) for i in range(0, len(xs) - 1, 2)]
        if len(xs) % 2:
            nxt.append(xs[-1])
        xs = nxt
    return xs[0]


# ----------------------------------------------------------------------------- thread geometry
def sa(*terms):
    """32-bit shared-window address expression: sum of u32 terms, constants folded last (so
    ptxas sees [reg + imm] and no 64-bit address arithmetic keeps registers busy)."""
    const = sum(t for t in terms if isinstance(t, int))
    names = [t for t in terms if not isinstance(t, int)]
    expr = names[0]
    for t in names[1:]:
        expr = f"a32({expr}, {t})"
    return f"a32({expr}, {const})" if const else expr


def load_rows_per_pass(v, rs):
    """rows of a (rows x rs bytes) tile one pass of the CTA's cp.async covers."""
    return v.NT // (rs // 16)


def thread_geometry(e, v):
    """lane decomposition used by every fragment emitter, plus this lane's swizzled shared offsets:
    xa{rs}_{c}: row lrow16, chunk 2c + mhi (A fragments of k-step c; B.trans of n-tile pair c);
    xb{rs}_{c}: row r8, chunk 4c + mi (B fragments of k-steps 2c, 2c+1);
    ls{rs}_{o}: tile-load slot of a pass starting o rows (mod 8) into the tile;
    xv{rs}_{e}_{p} (tf32): key row 2t + e, words 2g, 2g + 1 of n-tile pair p (mod 2) (mma_ab's B)."""
    e("tx = i64(cuda.threadIdx.x)")
    e("wid = tx // 32; lane = tx % 32; g = lane // 4; t = lane % 4")
    # ldmatrix: lanes 8*mi .. 8*mi+7 give the row addresses of 8x8 matrix mi
    e("mi = lane // 8; r8 = lane % 8; mlo = mi % 2; mhi = mi // 2; lrow16 = r8 + 8 * mlo")
    if v.fuse_dq and not v.wgmma and v.BM not in (v.D, v.Dv):   # A fragments of the dS tile (BM keys wide)
        rs = v.EB * v.BM
        for c in range(rs // 32):
            e(f"xa{rs}_{c} = u32(lrow16 * {rs} + (((({2 * c}) + mhi) ^ r8) * 16))")
    if v.wgmma:   # this warpgroup's first row in a resident tile (64 rows of 128 bytes)
        e("wga = u32((wid // 4) * 8192)")
    for width in sorted({v.D, v.Dv}):
        rs = v.row_bytes(width)
        if not v.wgmma:   # ldmatrix offsets (wgmma reads shared memory through descriptors)
            for c in range(rs // 32):
                e(f"xa{rs}_{c} = u32(lrow16 * {rs} + (((({2 * c}) + mhi) ^ r8) * 16))")
            for c in range(rs // 64):
                e(f"xb{rs}_{c} = u32(r8 * {rs} + (((({4 * c}) + mi) ^ r8) * 16))")
        cpr = rs // 16
        step = load_rows_per_pass(v, rs)
        for o in sorted({(i * step) % 8 for i in range(8)}):
            # a pass `o` rows (mod 8) further down swizzles with (row + o) % 8
            row = f"(tx // {cpr})" if o == 0 else f"((tx // {cpr}) + {o})"
            if v.wgmma:   # 128-byte rows of one 64-column group; load_tile adds the group's sub-tile
                e(f"ls{rs}_{o} = u32((tx // {cpr}) * 128 + ((((tx % {cpr}) % 8) ^ ({row} % 8)) * 16))")
            else:
                e(f"ls{rs}_{o} = u32((tx // {cpr}) * {rs} + (((tx % {cpr}) ^ ({row} % 8)) * 16))")
        if v.tf32:
            for ee in (0, 1):
                for p in (0, 1):
                    e(f"xv{rs}_{ee}_{p} = u32((2 * t + {ee}) * {rs} + ((({4 * p} + g // 2) ^ (2 * t + {ee})) * 16)"
                      f" + (g % 2) * 8)")


# ----------------------------------------------------------------------------- global -> shared
def load_tile(e, v, smem, gbase, gstride, nvalid, rows, width):
    """cp.async a (rows x width) tile, row r at gbase + r * gstride, into swizzled shared memory.
    Rows >= nvalid are zero-filled (src-size 0) and read nothing: tails never go out of bounds.
    wgmma variants store each 64-column group as its own (rows x 128 B) sub-tile, the canonical
    128-byte-swizzled layout of wgmma's descriptors (for D = 64 the same bytes as the row-major tile)."""
    rs = v.row_bytes(width)
    cpr = rs // 16                   # 16-byte chunks per row (wgmma: of the padded row)
    data = width * v.EB // 16        # ... of which hold data: the rest is zero-filled
    step = load_rows_per_pass(v, rs)  # rows covered by one pass of the CTA
    assert v.NT % cpr == 0 and rows % step == 0, (v, rows, width)
    e(f"# load_tile: {rows} x {width} from {gbase} (rows >= {nvalid} zero-filled) -> shared {smem}")
    e(f"lr = tx // {cpr}; lc = tx % {cpr}")
    # the pass stride goes through an opaque move: otherwise every pass's row offset is hoisted
    # out of the key loop and held in a 64-bit register pair for the whole loop (spills)
    e(f"gb = {gbase}; gs = opq({step} * {gstride}); ga = gb + lr * {gstride} + lc * 16")
    group = []
    if v.wgmma and cpr > 8:
        e(f"lgr = u32((lc // 8) * {rows * 128})")
        group = ["lgr"]
    pitch = 128 if v.wgmma else rs
    for i in range(rows // step):
        e(f"ok = u32(lr + {i * step} < {nvalid})" if data == cpr else f"ok = u32((lr + {i * step} < {nvalid}) & (lc < {data}))")
        e(f"cp_async16({sa(smem, f'ls{rs}_{(i * step) % 8}', *group, i * step * pitch)}, sel(ok != 0, ga, gb), ok * 16)")
        if i + 1 < rows // step:
            e("ga = ga + gs")


# ----------------------------------------------------------------------------- split (float32 on wgmma)
# A float32 tile reaches its bf16 parts in two steps: stage_tile cp.asyncs it unchanged into the
# staging tile (row-major, 16-byte chunk i * NT + tx per pass i), and convert_tile, once this thread's
# copies landed, reads back exactly the chunks this thread copied and writes their three parts into
# the wgmma layout. Each thread only ever reads its own chunks, so no barrier separates the two and the
# next block can be staged right after the conversion; the layout barrier (`landed`) follows.
def _split_chunk(e, v, i, rows, width):
    """row `fr` and 16-byte chunk `fc` of pass i (chunk i * NT + tx of the rows x width tile), from an
    opaque copy of the thread index so that nothing is hoisted out of the key loop into registers."""
    cpr = width // 4
    e(f"fz = i64(u32(opq(tx)) + {i * v.NT}); fr = {udiv('fz', cpr)}; fc = {umod('fz', cpr)}")


def stage_tile(e, v, stage, gbase, gstride, nvalid, rows, width):
    """split: cp.async a float32 (rows x width) tile into the staging tile (row-major, unswizzled);
    rows >= nvalid are zero-filled and read nothing."""
    e(f"# stage_tile: {rows} x {width} float32 from {gbase} (rows >= {nvalid} zero-filled) -> staging {stage}")
    e(f"gb = {gbase}")
    for i in range(rows * width // 4 // v.NT):
        _split_chunk(e, v, i, rows, width)
        e(f"ok = u32(fr < {nvalid})")
        e(f"cp_async16(a32({stage}, u32(fz * 16)), sel(ok != 0, gb + fr * {gstride} + fc * 16, gb), ok * 16)")


def convert_tile(e, v, stage, dst, rows, width):
    """split: this thread's staged chunks -> bf16 (hi, mid, lo) tiles at dst, dst + T, dst + 2T
    (T = rows x row_bytes): each in load_tile's wgmma layout (64-column sub-tiles of 128-byte rows,
    chunk c of row r at c ^ (r % 8)); 4 floats are half a 16-byte bf16 chunk."""
    T = rows * v.row_bytes(width)
    e(f"# convert_tile: staging {stage} -> bf16 parts {', '.join(SPLIT_PARTS)} of {dst}")
    for i in range(rows * width // 4 // v.NT):
        _split_chunk(e, v, i, rows, width)
        e(f"x0, x1, x2, x3 = lds_f32x4(a32({stage}, u32(fz * 16)))")
        e("h0, m0, q0 = split3x2(x0, x1); h1, m1, q1 = split3x2(x2, x3)")
        # bf16 column 4 fc: sub-tile fc // 16, 16-byte chunk (fc % 16) // 2, half fc % 2
        e(f"so = u32((fc // 16) * {rows * 128} + fr * 128 + ((((fc % 16) // 2) ^ (fr % 8)) * 16) + (fc % 2) * 8)")
        for p, (a, b) in enumerate((("h0", "h1"), ("m0", "m1"), ("q0", "q1"))):
            e(f"sts_u32x2({sa(dst, 'so', p * T)}, {a}, {b})")


# ----------------------------------------------------------------------------- fragments
def zero_c(e, name, MT, ntiles):
    for m in range(MT):
        for j in range(ntiles):
            e("; ".join(f"{name}{m}_{j}_{r} = zero" for r in range(4)))


def zero_c_tiles(e, name, MT, tiles):
    for m in range(MT):
        for j in tiles:
            e("; ".join(f"{name}{m}_{j}_{r} = zero" for r in range(4)))


def a_regs(v, A, m, ks):
    """register names of one A fragment: 4 packed x2 words, or (tf32) 4 big + 4 small halves."""
    return [f"{A}{m}_{ks}_{r}" for r in range(8 if v.tf32 else 4)]


def split_tf32(e, v, regs):
    """tf32: in-place split of raw fp32 words r -> (r big, r + 's' small); 16-bit: nothing."""
    if v.tf32:
        for x in regs:
            e(f"{x}, {x}s = tf32x2({x})")


def ldsm_a(e, v, A, m, ks, addr):
    """one A fragment from shared memory (ldmatrix; tf32: split into halves 0-3 big, 4-7 small)."""
    regs = a_regs(v, A, m, ks)
    e(f"{', '.join(regs[:4])} = ldsm_x4({addr})")
    if v.tf32:
        e("; ".join(f"{regs[r]}, {regs[r + 4]} = tf32x2({regs[r]})" for r in range(4)))


def mma(e, v, C, a, b):
    """C += A B for one m16 x n8 tile: a = a_regs(), b = [b0, b1] (tf32: their halves are b0, b0s, ...)."""
    c = ", ".join(C)
    if not v.tf32:
        e(f"{c} = mma16816({', '.join(a)}, {', '.join(b)}, {c})")
        return
    half_a = dict(big=a[:4], small=a[4:])
    half_b = dict(big=b, small=[x + "s" for x in b])
    for ha, hb in TF32_PASSES:
        e(f"{c} = mma1688({', '.join(half_a[ha])}, {', '.join(half_b[hb])}, {c})")


def c_regs(C, m, j):
    return [f"{C}{m}_{j}_{r}" for r in range(4)]


def load_a(e, v, name, smem, row0, MT, ksteps, rs):
    """A fragments (16 rows x one k-step) of m-tiles starting at local row `row0` + 16 m."""
    for m in range(MT):
        for ks in range(ksteps):
            ldsm_a(e, v, name, m, ks, sa(smem, f"u32({row0} * {rs})", f"xa{rs}_{ks}", 16 * m * rs))


def mma_abt(e, v, C, A, btile, ntiles, width, a_smem=None, wait=True):
    """C[m][j] += A[m] . B^T with B row-major [n][k] in shared memory (K for S = Q K^T), k = `width`
    elements. a_smem = (tile, row0): A is read from that shared tile per k-step pair instead of
    registers. One ldmatrix.x4 gives the B fragments of two k-steps (either dtype). wait=False
    (wgmma only): issued, C is read after wg_wait."""
    if v.wgmma:
        wg_abt(e, v, C, btile, ntiles, width, a_smem[0], wait)
        return
    assert wait, "mma.sync products complete in order"
    MT, rs, ksteps = v.MT, width * v.EB, v.ksteps(width)

    def one(j, kp):
        e(f"b0, b1, b2, b3 = ldsm_x4({sa(btile, f'xb{rs}_{kp}', j * 8 * rs)})")
        split_tf32(e, v, ["b0", "b1", "b2", "b3"])
        for kk, b in enumerate((["b0", "b1"], ["b2", "b3"])):
            for m in range(MT):
                mma(e, v, c_regs(C, m, j), a_regs(v, A, m, 2 * kp + kk), b)
    e(f"# mma_abt: {C} += {A} . B^T, B = shared {btile}" + (f", A from shared {a_smem[0]}" if a_smem else ""))
    if a_smem is None:
        for j in range(ntiles):
            for kp in range(ksteps // 2):
                one(j, kp)
        return
    tile, row0 = a_smem
    for kp in range(ksteps // 2):   # k outer: each A fragment is loaded once per block
        for ks in (2 * kp, 2 * kp + 1):
            for m in range(MT):
                ldsm_a(e, v, A, m, ks, sa(tile, f"u32({row0} * {rs})", f"xa{rs}_{ks}", 16 * m * rs))
        for j in range(ntiles):
            one(j, kp)


def resident(e, v, tiles, row0):
    """The CTA's own row tiles [(A name, global base, row stride, width), ...]: staged one by one
    into registers (A fragments), or kept in shared memory (v.kept_in_shared(): all with a_smem,
    K for the fused dQ). Returns {name: a_smem arg} (None where the A fragments are in registers),
    {name: shared base} of the kept tiles, and the first free shared byte for the streamed buffers."""
    where, kept, off = {}, {}, 0
    keep = v.kept_in_shared()
    if v.split:   # every resident tile is kept (a_smem), its parts made through the staging tile
        stage = sa("sb", v.staging_offset())
        for name, gbase, gstride, width in tiles:
            tile = sa("sb", off) if off else "sb"
            stage_tile(e, v, stage, gbase, gstride, "rows", v.BM, width)
            e("cp_commit(); cp_wait0()")
            convert_tile(e, v, stage, tile, v.BM, width)
            e("cuda.syncthreads()")   # the next tile's (or block's) chunks are other threads'
            kept[name] = tile
            where[name] = (tile, "wrow")
            off += v.parts * v.BM * v.row_bytes(width)
        landed(e, v)
        return where, kept, off
    for i, (name, gbase, gstride, width) in enumerate(tiles):
        if i in keep:
            tile = sa("sb", off) if off else "sb"
            load_tile(e, v, tile, gbase, gstride, "rows", v.BM, width)
            kept[name] = tile
            where[name] = (tile, "wrow") if v.a_smem else None
            off += v.BM * v.row_bytes(width)
    if kept:
        e("cp_commit(); cp_wait0()" + ("; fence_async()" if v.wgmma else "") + "; cuda.syncthreads()")
    for i, (name, gbase, gstride, width) in enumerate(tiles):
        if v.a_smem:
            continue
        if i in keep:   # registers and shared: fragments from the kept copy
            load_a(e, v, name, kept[name], "wrow", v.MT, v.ksteps(width), v.EB * width)
            continue
        stage = sa("sb", off) if off else "sb"
        load_tile(e, v, stage, gbase, gstride, "rows", v.BM, width)
        e("cp_commit(); cp_wait0(); cuda.syncthreads()")
        load_a(e, v, name, stage, "wrow", v.MT, v.ksteps(width), v.EB * width)
        e("cuda.syncthreads()")
        where[name] = None
    return where, kept, off


def a_pairs(C, m, ks):
    """FA2 register reuse: C fragments of n-tiles 2k, 2k+1 are exactly the A fragment of k-step k;
    A register r of k-step ks packs this pair of C values (low half first)."""
    return [(f"{C}{m}_{j}_{c}", f"{C}{m}_{j}_{c + 1}") for j in (2 * ks, 2 * ks + 1) for c in (0, 2)]


def c_to_a(e, A, C, MT, ksteps, after=None):
    """C fragments -> packed 16-bit A fragments (a_pairs), two registers a line; after(ks) (MT = 1)
    is emitted once k-step ks is packed: C tiles 2 ks, 2 ks + 1 may be overwritten from there on."""
    e(f"# c_to_a: {C} (f32 C fragments) -> {A} (packed A fragments)")
    for m in range(MT):
        for ks in range(ksteps):
            packed = [f"{A}{m}_{ks}_{r} = pack2({lo}, {hi})" for r, (lo, hi) in enumerate(a_pairs(C, m, ks))]
            e("; ".join(packed[:2]))
            e("; ".join(packed[2:]))
            if after is not None:
                after(ks)


def c_to_a_tf32(e, A, C, m, j):
    """tf32 register reuse: C tile j is the A fragment of k-step j with keys permuted
    (a0..a3 = c0, c2, c1, c3: key 2t is k t, key 2t + 1 is k t + 4), split into halves."""
    for r, src in enumerate((0, 2, 1, 3)):
        e(f"{A}{m}_{j}_{r}, {A}{m}_{j}_{r + 4} = tf32x2({C}{m}_{j}_{src})")


def mma_pb(e, v, O, A, P, btile, ntiles, nkeys, width, wait=True, packed=False):
    """O[m][j] += P[m] . B: P = C fragments (scores / probabilities over `nkeys` keys) reused as
    A fragments, B row-major [key][n] in shared memory (V for O += P V, K for dQ += dS K, ...).
    16-bit: c_to_a then ldmatrix.trans. tf32: per k-step (one C tile) the P tile is split and B is
    read with lds64 at the permuted keys and columns (module docstring)."""
    MT, rs = v.MT, width * v.EB
    if v.wgmma:
        wg_pb(e, v, O, A, P, btile, ntiles, nkeys, wait, packed)
        return
    assert wait and not packed, "mma.sync products complete in order and pack their own A"
    if not v.tf32:
        c_to_a(e, A, P, MT, nkeys // 16)
        e(f"# mma_ab: {O} += {A} . B, B = shared {btile} (ldmatrix.trans)")
        for ks in range(nkeys // 16):
            for jp in range(ntiles // 2):
                e(f"b0, b1, b2, b3 = ldsm_x4_t({sa(btile, f'xa{rs}_{jp}', ks * 16 * rs)})")
                for j, b in ((2 * jp, ["b0", "b1"]), (2 * jp + 1, ["b2", "b3"])):
                    for m in range(MT):
                        mma(e, v, c_regs(O, m, j), a_regs(v, A, m, ks), b)
        return
    e(f"# mma_pb (3xTF32): {O} += {P} . B, B = shared {btile} (lds64, permuted keys/columns)")
    npairs = ntiles // 2
    step = PB_PAIRS or npairs
    acc = f"{O}_t" if PB_PAIRS else O      # fresh partial tiles (see PB_PAIRS)
    for p0 in range(0, npairs, step):
        pairs = range(p0, min(p0 + step, npairs))
        if PB_PAIRS:
            zero_c_tiles(e, acc, MT, [j for jp in pairs for j in (2 * jp, 2 * jp + 1)])
        for ks in range(nkeys // 8):
            for m in range(MT):    # re-split per chunk: P's halves are not held across chunks
                c_to_a_tf32(e, A, P, m, ks)
            for jp in pairs:
                # key row 2t (b0) and 2t + 1 (b1); word 0 feeds n-tile 2jp, word 1 n-tile 2jp + 1
                e(f"u0, u1 = lds64({sa(btile, f'xv{rs}_0_{jp % 2}', ks * 8 * rs + 128 * (jp // 2))})")
                e(f"w0, w1 = lds64({sa(btile, f'xv{rs}_1_{jp % 2}', ks * 8 * rs + 128 * (jp // 2))})")
                split_tf32(e, v, ["u0", "u1", "w0", "w1"])
                for j, b in ((2 * jp, ["u0", "w0"]), (2 * jp + 1, ["u1", "w1"])):
                    for m in range(MT):
                        mma(e, v, c_regs(acc, m, j), a_regs(v, A, m, ks), b)
        if PB_PAIRS:
            for jp in pairs:
                for j in (2 * jp, 2 * jp + 1):
                    for m in range(MT):
                        e("; ".join(f"{x} = {x} + {y}" for x, y in zip(c_regs(O, m, j), c_regs(acc, m, j))))


# ----------------------------------------------------------------------------- wgmma (sm_90a)
# A warpgroup (4 consecutive warps) multiplies its 64 rows in one instruction per k-step of 16:
# wgmma.mma_async.m64nNk16, B (and, for A B^T products, A) read by the tensor cores straight from
# shared memory through descriptors, so an operand tile crosses shared memory once per warpgroup
# instead of once per warp through ldmatrix. Warp w % 4 of the group receives rows 16 (w % 4) ..
# + 15 in exactly mma.sync's C layout (c{r} of n-tile j), and register A operands use mma.sync's A
# layout, so softmax, masking, c_to_a and the stores are shared with the mma.sync kernels.
# Shared layout: the canonical 128-byte-swizzled one (chunk c of row r at c ^ (r % 8), 128-byte
# rows, tiles 1024-byte aligned), one (rows x 128 B) sub-tile per 64 columns (load_tile).
#   A B^T (S = Q K^T, dP = dO V^T, ...): A and B K-major; the k-step k16 of a sub-tile starts 32 B
#     further (the hardware applies the swizzle to the final address), the next 8 rows are 1024 B
#     away (SBO); k-steps 4-7 (D = 128) live in the second sub-tile.
#   P B (O += P V, dQ += dS K, ...): A = C fragments packed by c_to_a; B row-major [key][n] is
#     MN-major (imm-trans-b = 1): 8 keys at 128-B pitch, the next 8 at SBO, the next 64 columns at
#     LBO = one sub-tile.
def wg_desc(addr, lbo, sbo=1024):
    """the sm_90 wgmma shared-memory descriptor of a 128-byte-swizzled tile at `addr` (u32):
    start >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45:
    1024, the next 8 rows), swizzle mode 1 = 128 B (62-63). A k-step further is `+ offset >> 4`."""
    const = (lbo >> 4) << 16 | (sbo >> 4) << 32 | 1 << 62
    return f"(i64({addr} >> 4) | {const})"


def pb_groups(v, width):
    """column groups of a P B product with `width` output columns, one wgmma chain each: the whole
    width, or (split) groups of v.pb_cols columns, each accumulated per block in fresh partials
    (PB_PAIRS's reason: the fp32 accumulation truncates) and added to the accumulator with an fp32 add."""
    if not v.split:
        return [width]
    n = v.pb_cols
    return [n] * (width // n) + ([width % n] if width % n else [])


def _passes(v):
    """(A part, B part) index pairs of one product: SPLIT_PASSES, or the operands themselves."""
    if not v.split:
        return [(0, 0)]
    return [(SPLIT_PARTS.index(a), SPLIT_PARTS.index(b)) for a, b in SPLIT_PASSES]


def wg_abt(e, v, C, btile, ntiles, width, atile, wait=True):
    """C (this warp's 16 rows x 8 ntiles) += A B^T over k = width: A = this warpgroup's 64 rows of
    the resident tile `atile` (BM rows), B = `btile` (8 ntiles rows), both K-major. split: one chain
    over SPLIT_PASSES x k-steps, part p of a tile p x (its rows x row bytes) further."""
    nk, N = width // 16, 8 * ntiles
    e(f"# wgmma: {C} += A . B^T, A = shared {atile} (this warpgroup's rows), B = shared {btile}")
    e(f"da = {wg_desc(sa(atile, 'wga'), 16)}; db = {wg_desc(btile, 16)}")
    step = lambda ks, rows: ((ks // 4) * rows * 128 + (ks % 4) * 32) >> 4  # noqa: E731
    part = lambda p, rows: (p * rows * v.row_bytes(width)) >> 4  # noqa: E731
    steps = [(part(pa, v.BM) + step(ks, v.BM), part(pb, N) + step(ks, N)) for pa, pb in _passes(v) for ks in range(nk)]
    regs = [x for j in range(ntiles) for x in c_regs(C, 0, j)]
    e(f"{', '.join(regs)} = {e.chain('ss', N, steps, wait)}({', '.join(['da', 'db'] + regs)})")


def wg_wait(e, n, C, ntiles):
    """wgmma: wait until at most n issued chains are in flight; the one that completed is the one
    into C (ntiles n-tiles): its registers are handed back through ptx.wgmma_wait."""
    regs = [x for j in range(ntiles) for x in c_regs(C, 0, j)]
    e(f"{', '.join(regs)} = {e.wait(n, len(regs))}({', '.join(regs)})")


def c_to_a_split(e, A, C, nk, after=None):
    """split: C fragments -> the A fragments of the three bf16 parts ({A}h, {A}m, {A}l), one
    split3x2 per packed pair (a_pairs); after(ks) as in c_to_a."""
    e(f"# c_to_a_split: {C} -> {A}h / {A}m / {A}l (bf16 parts of the packed A fragments)")
    for ks in range(nk):
        for r, (lo, hi) in enumerate(a_pairs(C, 0, ks)):
            outs = ", ".join(f"{A}{p[0]}0_{ks}_{r}" for p in SPLIT_PARTS)
            e(f"{outs} = split3x2({lo}, {hi})")
        if after is not None:
            after(ks)


def wg_pack(e, v, A, C, nk, after=None):
    """wgmma: C fragments over nk k-steps -> the register A operands of a P B product (16-bit:
    packed pairs; split: three bf16 parts), after(ks) as in c_to_a."""
    if v.split:
        c_to_a_split(e, A, C, nk, after)
    else:
        c_to_a(e, A, C, 1, nk, after)


def wg_pb(e, v, O, A, P, btile, ntiles, nkeys, wait=True, packed=False):
    """O (16 rows x 8 ntiles) += P B: P = C fragments over `nkeys` keys (c_to_a), B = `btile`
    [key][n] (nkeys rows), MN-major. split: per pb_groups column group, a chain over SPLIT_PASSES x
    k-steps into fresh partials, then added. wait=False (not split: one chain): issued, O is read
    after wg_wait; P may change meanwhile (the chain reads the packed copy A). packed: A already
    holds P's operands (wg_pack)."""
    assert wait or not v.split, "split P B products add their partials after the chain"
    nk, width = nkeys // 16, 8 * ntiles
    if not packed:
        wg_pack(e, v, A, P, nk)
    e(f"# wgmma: {O} += {A} . B, B = shared {btile} (MN-major)")
    e(f"db = {wg_desc(btile, nkeys * 128)}")
    # register A groups: k-step ks of the i-th part the passes use is group i * nk + ks
    used = sorted({pa for pa, _ in _passes(v)})
    names = [f"{A}{SPLIT_PARTS[p][0]}" if v.split else A for p in used]
    aregs = [x for a in names for ks in range(nk) for x in a_regs(v, a, 0, ks)]
    j0 = 0
    for n in pb_groups(v, width):
        # group columns 8 j0 .. : sub-tile j0 // 8 of B (nkeys rows of 128 bytes each), 16 bytes
        # further per 8 columns inside it (the swizzle is applied to the final address)
        col = (j0 // 8) * nkeys * 128 + (j0 % 8) * 16
        steps = [(used.index(pa) * nk + ks, (pb * nkeys * v.row_bytes(width) + col + ks * 16 * 128) >> 4)
                 for pa, pb in _passes(v) for ks in range(nk)]
        tiles = range(j0, j0 + n // 8)
        partials = v.split and SPLIT_PARTIALS
        acc = f"{O}_t" if partials else O
        if partials:
            zero_c_tiles(e, acc, 1, tiles)
        regs = [x for j in tiles for x in c_regs(acc, 0, j)]
        e(f"{', '.join(regs)} = {e.chain('rs', n, steps, wait)}({', '.join(aregs + ['db'] + regs)})")
        if partials:
            for j in tiles:
                e("; ".join(f"{x} = {x} + {y}" for x, y in zip(c_regs(O, 0, j), c_regs(acc, 0, j))))
        j0 += n // 8


# ----------------------------------------------------------------------------- masking
def row_limits(e, v, lim, row_base):
    """Per fragment row: number of admitted columns. Non-causal: all `cols` of the block;
    causal: columns j_local <= i_local, i.e. < diag + row + 1 (diag = local index of row 0)."""
    for m in range(v.MT):
        for h in (0, 1):
            e(f"rl = {row_base} + {16 * m + 8 * h} + g")
            e(f"{lim}{m}{h} = sel(causal != 0, imin(cols, diag + rl + 1), cols)")


def mask_rows(e, C, MT, ntiles, col0, lim):
    """C[m][j][r] = MASKED where column col0 + 8 j + 2 t + r % 2 >= the row's limit (rows of the C tile)."""
    e(f"# mask_rows: {C} columns >= {lim} (tail / causal diagonal)")
    for m in range(MT):
        for j in range(ntiles):
            for r in range(4):
                x = f"{C}{m}_{j}_{r}"
                e(f"{x} = sel({col0} + {8 * j + r % 2} + 2 * t < {lim}{m}{r // 2}, {x}, masked)")


# ----------------------------------------------------------------------------- online softmax
def online_softmax(e, v, S, O, nt_o, rowmax=None):
    """Running (max, sum) update in the exp2 domain; S becomes P (unnormalised); O rescaled.
    A row whose max is still MASKED only meets masked tiles; its l stays 0 and nothing is read.
    rowmax: names of the rows' raw maxima already reduced over the quad (prune_gate's), by (m, h).
    Every visiting order must give each row a real key in its first tile: on an all-masked first
    tile the running max would become MASKED * sc and, with FMA contraction, exp2 of the rounding
    error of MASKED * sc could overflow."""
    e(f"# online_softmax: running max/sum of {S}, {S} -> P, rescale {O}")
    mx = lambda a, b: f"fmaxf({a}, {b})"
    ad = lambda a, b: f"({a} + {b})"
    nt = v.BN // 8
    for m in range(v.MT):
        for h in (0, 1):
            rs = (0, 1) if h == 0 else (2, 3)
            if rowmax is None:
                e("x = " + _tree(mx, [f"{S}{m}_{j}_{r}" for j in range(nt) for r in rs]))
                e("x = fmaxf(x, shfl_xor(x, 1))")   # the 4 lanes of a quad share a row
                e("x = fmaxf(x, shfl_xor(x, 2))")
            else:
                e(f"x = {rowmax[m, h]}")
            e(f"mn = fmaxf(m{m}{h}, x * sc)")
            e(f"al{h} = ex2(m{m}{h} - mn)")
            e(f"m{m}{h} = mn")
            for j in range(nt):
                for r in rs:
                    e(f"{S}{m}_{j}_{r} = ex2({S}{m}_{j}_{r} * sc - mn)")
            e(f"l{m}{h} = l{m}{h} * al{h} + " + _tree(ad, [f"{S}{m}_{j}_{r}" for j in range(nt) for r in rs]))
        for j in range(nt_o):
            e(f"{O}{m}_{j}_0 = {O}{m}_{j}_0 * al0; {O}{m}_{j}_1 = {O}{m}_{j}_1 * al0; "
              f"{O}{m}_{j}_2 = {O}{m}_{j}_2 * al1; {O}{m}_{j}_3 = {O}{m}_{j}_3 * al1")


# ----------------------------------------------------------------------------- stores
def store_c_rows(e, v, C, ntiles, gbase, gstride, row_base, nvalid, scale_of):
    """Store mma_pb's C fragments to rows gbase + row * gstride, rows < nvalid: 16-bit as x2 pairs
    (4-byte stores); tf32 (columns permuted in n-tile pairs, see mma_pb) as 4 consecutive floats
    (16-byte stores). scale_of(m, h) is the expression multiplying the row (1/l, the softmax scale, ...)."""
    for m in range(v.MT):
        for h in (0, 1):
            e(f"rl = {row_base} + {16 * m + 8 * h} + g")
            e(f"ok = u32(rl < {nvalid}); ga = {gbase} + sel(ok != 0, rl, 0) * {gstride} + t * {16 if v.tf32 else 8 if v.split else 4}")
            f = scale_of(m, h)
            r0, r1 = 2 * h, 2 * h + 1
            if v.tf32:
                for jp in range(ntiles // 2):
                    a, b = 2 * jp, 2 * jp + 1
                    vals = [f"{C}{m}_{a}_{r0}", f"{C}{m}_{b}_{r0}", f"{C}{m}_{a}_{r1}", f"{C}{m}_{b}_{r1}"]
                    e(f"stg_v4_if(ok, ga + {64 * jp}, {', '.join(x + ' * ' + f for x in vals)})")
                continue
            if v.split:   # float32 outputs in the natural column order: 8 bytes per n-tile
                for j in range(ntiles):
                    e(f"stg_v2_if(ok, ga + {32 * j}, {C}{m}_{j}_{r0} * {f}, {C}{m}_{j}_{r1} * {f})")
                continue
            for j in range(ntiles):
                e(f"stg_u32_if(ok, ga + {16 * j}, pack2({C}{m}_{j}_{r0} * {f}, {C}{m}_{j}_{r1} * {f}))")


def shared_base(e, v):
    """sb: the first byte of the CTA's tiles (wgmma: rounded up to WG_ALIGN, see there)."""
    if v.wgmma:
        e(f"sb = u32((saddr(sm) + {WG_ALIGN - 1}) // {WG_ALIGN} * {WG_ALIGN})")
    else:
        e("sb = saddr(sm)")


def landed(e, v):
    """the barrier after this thread's cp.async copies landed: wgmma reads shared memory through
    the async proxy, so (wgmma only) each thread first fences its generic-proxy writes for it."""
    e("fence_async(); cuda.syncthreads()" if v.wgmma else "cuda.syncthreads()")


def shared_array(e, v):
    if v.dynamic_smem:   # sized at launch (Compiled passes v.smem_bytes())
        e("sm = cuda.shared.array(0, u8)")
    else:
        e(f"sm = cuda.shared.array({v.smem_bytes()}, u8, alignment=128)")


# ----------------------------------------------------------------------------- work-table prologue
def read_work(e, v, index="i64(cuda.blockIdx.x)"):
    """This CTA's row of the work table (schedule.py): which rows it owns and which block they face.
    `rows` is capped at the tile; `rows_left` keeps the block's rows from row0 on."""
    e(f"wa = work + {index} * {4 * len(WORK_FIELDS)}")
    for i, f in enumerate(WORK_FIELDS):
        e(f"{f} = i64(ldg_i32(wa + {4 * i}))")
    if v.fuse_dq:
        e("rows_left = rows")
    e(f"rows = imin(rows, {v.BM})")


class StreamedPair:
    """The two tiles a loop streams per block (K and V for the forward and dQ kernels, Q and dO for
    dK/dV), named `{a}buf_*` / `{b}buf_*`, `widths` = their head dims, from shared byte `ss` on.
    16-bit and 3xTF32: a cp.async double buffer, block i + 1 lands in the other half while block i
    computes. split: one block buffer of bf16 parts, the next block lands in the float32 staging
    tile and is converted at the top of its iteration (stage_tile / convert_tile)."""

    def __init__(self, e, v, names, widths):
        self.e, self.v, self.names, self.widths = e, v, names, widths
        BN = v.BN
        self.sizes = [BN * v.row_bytes(w) for w in widths]   # one buffer of one part
        a, b = names
        e(f"{a}buf_0 = ss; {b}buf_0 = a32(ss, {v.stream_buffers * v.parts * self.sizes[0]})")
        if v.split:
            e(f"st{a} = {sa('sb', v.staging_offset())}; st{b} = a32(st{a}, {4 * BN * widths[0]})")

    def load(self, slot, sources):
        """copy the block whose rows start at sources = [(global base, row stride, valid rows)] per
        tile into buffer `slot` ("0" or "nxt"), or (split) the staging tile."""
        e, v = self.e, self.v
        for name, w, (gbase, gstride, nvalid) in zip(self.names, self.widths, sources):
            if v.split:
                stage_tile(e, v, f"st{name}", gbase, gstride, nvalid, v.BN, w)
            else:
                load_tile(e, v, f"{name}buf_{slot}", gbase, gstride, nvalid, v.BN, w)

    def current(self, it):
        """top of iteration `it`: {a}buf_cur / {b}buf_cur, landed in this thread (split: converted)."""
        e, v, (a, b), (A, B) = self.e, self.v, self.names, self.sizes
        if v.split:
            e(f"{a}buf_cur = {a}buf_0; {b}buf_cur = {b}buf_0")
            e("cp_wait0()")
            for name, w in zip(self.names, self.widths):
                convert_tile(e, v, f"st{name}", f"{name}buf_cur", v.BN, w)
            return
        e(f"cur = {it} % 2")
        e(f"{a}buf_cur = a32(ss, u32(cur * {A})); {b}buf_cur = a32(ss, u32({2 * A} + cur * {B}))")

    def prefetch(self, sources):
        """(inside `if it + 1 < n:`) start the next block's copy."""
        e, v, (a, b), (A, B) = self.e, self.v, self.names, self.sizes
        if not v.split:
            e(f"nxt = 1 - cur; {a}buf_nxt = a32(ss, u32(nxt * {A})); {b}buf_nxt = a32(ss, u32({2 * A} + nxt * {B}))")
        self.load("nxt", sources)
        e("cp_commit()" if v.split else "cp_commit(); cp_wait1()")

    def last(self):
        """(after the prefetch branch) the last block has no successor: wait for it (split: done)."""
        if not self.v.split:
            self.e("else:")
            with self.e.indent():
                self.e("cp_wait0()")


def stream_key_blocks(e, v, qa_where, block, issue=None):
    """The key loop of the forward and dQ kernels: the block's K/V tiles stream through StreamedPair
    (block kb+1 is copied while kb computes); per block S = Q K^T, masked only where the
    block crosses the causal diagonal or the tail (kb >= nfull), then block(kbuf, vbuf) emits the
    kernel's own use of S with the current buffers; issue(kbuf, vbuf), if given, right after S (a
    wgmma product issued there runs while S is masked and exponentiated). Expects ss, kg, vg,
    cols, nkb, nfull."""
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    # the key blocks in key order, or (pruning) the near ones first so that the running max is set
    # early: from the block holding key `diag` (the one facing the query tile; causal: its first
    # row's diagonal), wrapping around. That block holds a real key of every row of the tile
    # (online_softmax needs one in each row's first tile).
    it = "it" if v.prune else "kb"
    if v.prune:
        e(f"kstart = imin({udiv('diag', BN)}, nkb - 1)")
        order = lambda i: f"sel({i} + kstart >= nkb, {i} + kstart - nkb, {i} + kstart)"  # noqa: E731
    kv = StreamedPair(e, v, ("k", "v"), (D, Dv))
    block_at = lambda c: [(f"kg + {c} * k_rs", "k_rs", f"cols - {c}"), (f"vg + {c} * v_rs", "v_rs", f"cols - {c}")]  # noqa: E731
    e("if nkb > 0:")
    with e.indent():
        e(f"c0 = {order('0') if v.prune else '0'} * {BN}")
        kv.load("0", block_at("c0"))
        e("cp_commit()")
    e(f"for {it} in range(nkb):")
    with e.indent():
        if v.prune:
            e(f"kb = {order('it')}")
        kv.current(it)
        e(f"if {it} + 1 < nkb:")
        with e.indent():
            e(f"c1 = {order('it + 1') if v.prune else '(kb + 1)'} * {BN}")
            kv.prefetch(block_at("c1"))
        kv.last()
        landed(e, v)
        zero_c(e, "s", MT, BN // 8)
        mma_abt(e, v, "s", "qa", "kbuf_cur", BN // 8, D, qa_where)
        if issue is not None:
            issue("kbuf_cur", "vbuf_cur")
        e("if kb >= nfull:")
        with e.indent():
            row_limits(e, v, "lim", "wrow")   # computed here only: no registers held in the loop
            mask_rows(e, "s", MT, BN // 8, f"kb * {BN}", "lim")
        block("kbuf_cur", "vbuf_cur")
        e("cuda.syncthreads()")   # buffer `cur` is refilled by the next iteration's prefetch


# ============================================================================= forward
def prune_gate(e, v):
    """Tile-pruning admission (docs/design.md): admit iff the running max R over the whole query tile is
    still unset or max(tile scores) T >= R + ln(rho), both over this CTA's real rows (tail rows
    hold zero-filled queries), in the exp2 domain (ln(rho) arrives as lg2rho = log2(rho)).
    T >= R + c holds iff some thread's own rows reach R + c, so one barrier-or decides for the
    CTA; R is kept uniform in every thread: an admitted tile raises it to max(R, T), T read from
    the per-warp maxima each warp left in shared memory before the barrier (the next tile's
    writes come after two more barriers: the one ending this tile and the next one's `landed`).
    Returns the rows' quad-reduced raw maxima for online_softmax."""
    mx = lambda a, b: f"fmaxf({a}, {b})"  # noqa: E731
    e("# prune_gate: admit this tile? (T >= R + ln rho, R = the query tile's running max)")
    e("tl = masked")
    rowmax = {}
    for m in range(v.MT):
        for h in (0, 1):
            rs = (0, 1) if h == 0 else (2, 3)
            x = rowmax[m, h] = f"xr{m}{h}"
            e(f"{x} = " + _tree(mx, [f"s{m}_{j}_{r}" for j in range(v.BN // 8) for r in rs]))
            e(f"{x} = fmaxf({x}, shfl_xor({x}, 1)); {x} = fmaxf({x}, shfl_xor({x}, 2))")
            e(f"tl = fmaxf(tl, sel(wrow + {16 * m + 8 * h} + g < rows, {x} * sc, masked))")
    e("tl = fmaxf(tl, shfl_xor(tl, 4)); tl = fmaxf(tl, shfl_xor(tl, 8)); tl = fmaxf(tl, shfl_xor(tl, 16))")
    e("sts_f32(a32(prs, u32(wid * 4)), tl)")
    e("adm = u32(cuda.syncthreads_or(u32((rcta <= masked) | (tl >= rcta + lg2rho))))")
    e("if adm != 0:")
    with e.indent():
        for c in range(-(-v.NW // 4)):   # 16-byte loads: four warps' maxima each
            e(f"y0, y1, y2, y3 = lds_f32x4(a32(prs, {16 * c}))")
            e("rcta = fmaxf(rcta, fmaxf(fmaxf(y0, y1), fmaxf(y2, y3)))")
    return rowmax


def gen_forward(v):
    """O = softmax(scale Q K^T) V over one block of the relation per work row; writes O, m, l.
    Pipeline: Q tile resident (registers or shared); K/V blocks double-buffered through cp.async."""
    v.check()
    e = Source()
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    rsv = v.GB * Dv   # bytes of one head's output row
    e("def kernel(qp, kp, vp, op, mp, lp, work, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, o_rs, group, "
      + ("cntp, sc, minf, lg2rho):" if v.prune else "sc, minf):"))
    with e.indent():
        thread_geometry(e, v)
        e(f"hh = i64(cuda.blockIdx.y); hk = {udiv('hh', 'group')}")
        read_work(e, v)
        shared_array(e, v)
        shared_base(e, v)
        e("zero = f32(0.0); masked = f32(%r)" % MASKED)
        e(f"wrow = wid * {16 * MT}")   # this warp's first row inside the CTA tile
        # keys this tile can see: all of the block, or (causal) up to its last row's diagonal
        e("kend = sel(causal != 0, imin(cols, diag + rows), cols)")
        e(f"nkb = (kend + {BN - 1}) // {BN}")
        # key blocks with no masked entry: before the tail and (causal) left of every row's diagonal
        e(f"nfull = sel(causal != 0, imin(cols // {BN}, (diag + 1) // {BN}), cols // {BN})")
        e("qg = qp + row0 * q_rs + hh * q_hs")
        e("kg = kp + col0 * k_rs + hk * k_hs")
        e("vg = vp + col0 * v_rs + hk * v_hs")
        # stage 1: the Q tile, resident for the whole loop (registers, or shared with a_smem)
        where, _, off = resident(e, v, [("qa", "qg", "q_rs", D)], "wrow")
        e(f"ss = {sa('sb', off) if off else 'sb'}")   # first byte of the streamed buffers
        zero_c(e, "o", MT, Dv // 8)
        for m in range(MT):
            e(f"m{m}0 = masked; m{m}1 = masked; l{m}0 = zero; l{m}1 = zero")
        # stage 2: stream key blocks; S = Q K^T of each, then softmax and O += P V
        def block(kbuf, vbuf):
            if not v.prune:
                online_softmax(e, v, "s", "o", Dv // 8)
                mma_pb(e, v, "o", "pa", "s", vbuf, Dv // 8, BN, Dv)
                return
            rowmax = prune_gate(e, v)   # a pruned tile skips the softmax and the value product
            e("if adm != 0:")
            with e.indent():
                online_softmax(e, v, "s", "o", Dv // 8, rowmax)
                mma_pb(e, v, "o", "pa", "s", vbuf, Dv // 8, BN, Dv)
            e("npr = npr + sel(adm != 0, 0, 1)")
        if v.prune:
            e(f"prs = a32(sb, {v.smem_bytes() - v.prune_bytes() - (WG_ALIGN if v.wgmma else 0)}); npr = i64(0); rcta = masked")
        stream_key_blocks(e, v, where["qa"], block)
        # stage 3: finish the quad's row sums, normalise, store O, m (natural log), l
        for m in range(MT):
            for h in (0, 1):
                e(f"l{m}{h} = l{m}{h} + shfl_xor(l{m}{h}, 1)")
                e(f"l{m}{h} = l{m}{h} + shfl_xor(l{m}{h}, 2)")
                e(f"iv{m}{h} = sel(l{m}{h} > zero, f32(1.0) / l{m}{h}, zero)")
        store_c_rows(e, v, "o", Dv // 8, f"op + row0 * o_rs + hh * {rsv}", "o_rs", "wrow", "rows",
                     lambda m, h: f"iv{m}{h}")
        e("H = o_rs // %d" % rsv)
        for m in range(MT):
            for h in (0, 1):
                e(f"rl = wrow + {16 * m + 8 * h} + g")
                e("ok = u32((rl < rows) & (t == 0)); gi = (row0 + sel(ok != 0, rl, 0)) * H + hh")
                e(f"stg_f32_if(ok, mp + gi * 4, sel(l{m}{h} > zero, m{m}{h} * f32({1 / LOG2E!r}), minf))")
                e(f"stg_f32_if(ok, lp + gi * 4, l{m}{h})")
        if v.prune:   # this CTA's (pruned, visited) tile counts, one slot per CTA: summed on the host
            e("ok = u32(tx == 0); slot = cntp + (i64(cuda.blockIdx.x) * H + hh) * 8")
            e("stg_u32_if(ok, slot, u32(npr)); stg_u32_if(ok, slot + 4, u32(nkb))")
    return e.text()


# ============================================================================= backward: dQ
def gen_dq(v):
    """dQ = scale * sum_j dS_ij K_j over the key blocks of each query tile (deterministic: one CTA
    owns its rows). P = exp2(s * sc - lse2) from the forward's (m, l); dS = P (dP - Delta)."""
    v.check()
    e = Source()
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    rsk = v.GB * D
    e("def kernel(qp, kp, vp, dop, lsep, dltp, dqp, work, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, do_rs, do_hs,"
      " dq_rs, group, sc, scale):")
    with e.indent():
        thread_geometry(e, v)
        e(f"hh = i64(cuda.blockIdx.y); hk = {udiv('hh', 'group')}")
        read_work(e, v)
        shared_array(e, v)
        shared_base(e, v)
        e("zero = f32(0.0); masked = f32(%r)" % MASKED)
        e(f"wrow = wid * {16 * MT}")
        e("kend = sel(causal != 0, imin(cols, diag + rows), cols)")
        e(f"nkb = (kend + {BN - 1}) // {BN}")
        e(f"nfull = sel(causal != 0, imin(cols // {BN}, (diag + 1) // {BN}), cols // {BN})")
        e("kg = kp + col0 * k_rs + hk * k_hs")
        e("vg = vp + col0 * v_rs + hk * v_hs")
        # resident operands: this tile's Q and dO rows
        where, _, off = resident(e, v, [("qa", "qp + row0 * q_rs + hh * q_hs", "q_rs", D),
                                     ("da", "dop + row0 * do_rs + hh * do_hs", "do_rs", Dv)], "wrow")
        e(f"ss = {sa('sb', off) if off else 'sb'}")
        e("H = dq_rs // %d" % rsk)
        for m in range(MT):
            for h in (0, 1):
                e(f"rl = wrow + {16 * m + 8 * h} + g")
                e("ok = u32(rl < rows); gi = (row0 + sel(ok != 0, rl, 0)) * H + hh")
                e(f"ls{m}{h} = ldg_f32_if(ok, lsep + gi * 4); dl{m}{h} = ldg_f32_if(ok, dltp + gi * 4)")
        zero_c(e, "acc", MT, D // 8)

        def issue(kbuf, vbuf):   # wgmma: dP = dO V^T runs while S is masked and exponentiated
            zero_c(e, "dp", MT, BN // 8)
            mma_abt(e, v, "dp", "da", vbuf, BN // 8, Dv, where["da"], wait=False)

        def block(kbuf, vbuf):   # dP = dO V^T, dS = P (dP - Delta), dQ += dS K
            if v.wg_async:
                for j in range(BN // 8):
                    for r in range(4):
                        e(f"s0_{j}_{r} = ex2(s0_{j}_{r} * sc - ls0{r // 2})")
                wg_wait(e, 0, "dp", BN // 8)
                for j in range(BN // 8):
                    for r in range(4):
                        e(f"s0_{j}_{r} = s0_{j}_{r} * (dp0_{j}_{r} - dl0{r // 2})")
            else:
                zero_c(e, "dp", MT, BN // 8)
                mma_abt(e, v, "dp", "da", vbuf, BN // 8, Dv, where["da"])
                for m in range(MT):
                    for j in range(BN // 8):
                        for r in range(4):
                            s, dp = f"s{m}_{j}_{r}", f"dp{m}_{j}_{r}"
                            e(f"{s} = ex2({s} * sc - ls{m}{r // 2}) * ({dp} - dl{m}{r // 2})")
            mma_pb(e, v, "acc", "sa", "s", kbuf, D // 8, BN, D)
        stream_key_blocks(e, v, where["qa"], block, issue if v.wg_async else None)
        store_c_rows(e, v, "acc", D // 8, f"dqp + row0 * dq_rs + hh * {rsk}", "dq_rs", "wrow", "rows",
                     lambda m, h: "scale")
    return e.text()


def col_stats(e, tiles, name, ptr):
    """per-column float32 statistic (lse2 or Delta) of the query block at cq, for this lane's columns
    of the n-tiles `tiles`."""
    for j in tiles:
        for c in (0, 1):
            e(f"ci = cq + {8 * j + c} + 2 * t; ok = u32(ci < cols)")
            e(f"{name}{j}{c} = ldg_f32_if(ok, {ptr} + ((col0 + sel(ok != 0, ci, 0)) * H + hq) * 4)")


# ============================================================================= fused dQ (dkdv, fuse_dq)
# The dK/dV kernel already holds dS^T = (P (dP - Delta))^T for its key tile and one query block, so
# dQ_block += dS K costs one more product instead of the dQ kernel's three (S, dP, dQ): 5 products
# in all. Each key tile's contribution is added to a float32 accumulator in a fixed order (its rank
# among the key tiles that visit the query block), so the bits do not depend on timing: a turn
# counter per (query block, head), acquire/release at GPU scope. A CTA only ever waits for a lower
# rank, i.e. a CTA launched earlier (work rows keep the key tiles of a block in increasing order and
# the grid is flat, key tile-major), which is what makes the wait deadlock-free; heads are
# interleaved in the grid so that no wave holds many ranks of one head (a staircase of waits).
# The add runs one step behind (stage_dq, then fetch_acc / flush_dq during the next block), so the
# turn has usually arrived and the running sum's L2 trip overlaps four products. dq_atomic instead
# adds with red.global (FA2's scheme, not deterministic). Measured on the H200, neither beat the
# two-kernel backward at 16-bit; the atomic one did in float32 (docs/tensor_cores.md), which is why
# api ships the two-kernel backward by default and offers the atomic one as an opt-in.
def dq_geometry(e, v, part):
    """per-lane offsets of the fused dQ, emitted where they are used, from an opaque copy of the
    thread index: computed once at kernel start they were ~20 loop-long registers, and the kernel
    spills at 255. part: "store" (kv{m}{h} key-row guards, dso{m}{h}{q} transposed dS store offsets:
    key half h of m-tile m, query parity q), "mma" (this warp's dQ rows qrow / columns qcol and their
    byte offsets), "stage" (sqo: stage_dq's fragment rows), "move" (fr, fc, fo: 16-byte row chunks)."""
    rsA, RS = v.EB * v.BM, v.dq_stage_row()
    e("tz = opq(tx); wz = tz // 32; gz = (tz % 32) // 4; tz4 = tz % 4")
    if part in ("mma", "stage"):
        WR, WC, MQ, NQ = v.dq_warps()
        e(f"qrow = (wz // {WC}) * {16 * MQ}; qcol = (wz % {WC}) * {v.D // WC}")
    if part == "mma":
        e(f"qrowoff = u32(qrow * {rsA}); qcolb = u32(qcol * {v.EB})")
    elif part == "stage":
        e(f"sqo = u32((qrow + gz) * {RS} + qcol * 4 + tz4 * {16 if v.tf32 else 8})")
    elif part == "move":
        e(f"fr = tz // {v.D // 4}; fc = tz % {v.D // 4}; fo = u32(fr * {RS} + fc * 16)")
    elif part == "store":
        for m in range(v.MT):
            for h in (0, 1):
                e(f"kv{m}{h} = u32(wz * {16 * v.MT} + {16 * m + 8 * h} + gz < rows)")
                key8 = f"(wz * {2 * v.MT} + {2 * m + h})"   # the key's 16-byte-chunk group (8 keys)
                # tf32: key 8c + 2i + e sits at word i + 4e of its group (mma_pb's key order)
                chunk, within = (f"(2 * {key8} + gz % 2)", "(gz // 2) * 4") if v.tf32 else (key8, "2 * gz")
                for q in (0, 1):
                    e(f"dso{m}{h}{q} = u32((2 * tz4 + {q}) * {rsA} + (({chunk} ^ (2 * tz4 + {q})) * 16) + {within})")


def store_ds(e, v, dsb):
    """dS^T (C fragments: this warp's key rows x the block's queries) -> the query-major dS tile in
    shared memory. Key rows past the tile are stored as 0: their K rows are zero-filled, so their
    "probabilities" are not bounded and could overflow (0 * inf). 16-bit: the halves of the packed A
    registers c_to_a made for dK; tf32: the f32 values."""
    rsA = v.EB * v.BM
    e(f"# store_ds: dS^T fragments -> shared dS (query-major, {v.BN} x {v.BM})")
    dq_geometry(e, v, "store")
    for m in range(v.MT):
        if v.tf32:
            for j in range(v.BN // 8):
                for r in range(4):
                    h, q = r // 2, r % 2
                    e(f"sts_f32({sa(dsb, f'dso{m}{h}{q}', 8 * j * rsA)}, sel(kv{m}{h} != 0, s{m}_{j}_{r}, zero))")
            continue
        for ks in range(v.BN // 16):
            for r in range(4):   # a{r}: key half r % 2, queries 16 ks + 8 (r // 2) + 2t, +1
                h, off = r % 2, (16 * ks + 8 * (r // 2)) * rsA
                e(f"sts_halves({sa(dsb, f'dso{m}{h}0', off)}, {sa(dsb, f'dso{m}{h}1', off)}, "
                  f"sel(kv{m}{h} != 0, sa{m}_{ks}_{r}, u32(0)))")


def mma_dq(e, v, C, A, dsb, ktile):
    """C = dS . K for this warp's share of the block (MQ m16 query tiles x NQ column pairs, k = the
    BM keys): A = dS rows from shared (ldmatrix), B = K rows in shared (16-bit: ldmatrix.trans;
    tf32: lds64 at mma_pb's permuted keys and columns, matching store_ds's key order)."""
    WR, WC, MQ, NQ = v.dq_warps()
    rsA, rsk = v.EB * v.BM, v.EB * v.D
    e(f"# mma_dq: {C} = dS . K (dS rows from qrow, K columns from qcol)")
    dq_geometry(e, v, "mma")
    zero_c(e, C, MQ, 2 * NQ)
    for ks in range(v.ksteps(v.BM)):
        for mq in range(MQ):
            ldsm_a(e, v, A, mq, ks, sa(dsb, "qrowoff", f"xa{rsA}_{ks}", 16 * mq * rsA))
        for jp in range(NQ):
            if v.tf32:
                for x, ee in (("u", 0), ("w", 1)):
                    e(f"{x}0, {x}1 = lds64({sa(ktile, 'qcolb', f'xv{rsk}_{ee}_{jp % 2}', ks * 8 * rsk + 128 * (jp // 2))})")
                split_tf32(e, v, ["u0", "u1", "w0", "w1"])
                tiles = ((2 * jp, ["u0", "w0"]), (2 * jp + 1, ["u1", "w1"]))
            else:
                e(f"b0, b1, b2, b3 = ldsm_x4_t({sa(ktile, 'qcolb', f'xa{rsk}_{jp}', ks * 16 * rsk)})")
                tiles = ((2 * jp, ["b0", "b1"]), (2 * jp + 1, ["b2", "b3"]))
            for j, b in tiles:
                for mq in range(MQ):
                    mma(e, v, c_regs(C, mq, j), a_regs(v, A, mq, ks), b)


def dq_row_vectors(v, C):
    """this warp's dQ block (C fragments of mma_dq) as row pieces in natural column order:
    (m-tile, half, byte offset in the row, values) with offset from the lane's first column. tf32
    (mma_pb's pair layout): n-tile pair jp holds columns 16 jp + 4t .. + 3, four floats; 16-bit:
    n-tile j holds 8 j + 2t, + 1, two floats."""
    WR, WC, MQ, NQ = v.dq_warps()
    for mq in range(MQ):
        for h in (0, 1):
            r0, r1 = 2 * h, 2 * h + 1
            if v.tf32:
                for jp in range(NQ):
                    a, b = c_regs(C, mq, 2 * jp), c_regs(C, mq, 2 * jp + 1)
                    yield mq, h, 64 * jp, (a[r0], b[r0], a[r1], b[r1])
            else:
                for j in range(2 * NQ):
                    c = c_regs(C, mq, j)
                    yield mq, h, 32 * j, (c[r0], c[r1])


def stage_dq(e, v, C):
    """this block's dQ (C fragments) -> the float32 staging tile `sq` (natural column order); it is
    added to the running sum one step later (flush_dq), when the turn has long arrived."""
    RS = v.dq_stage_row()
    e(f"# stage_dq: {C} -> shared sq (float32, {v.BN} x {v.D})")
    dq_geometry(e, v, "stage")
    for mq, h, off, vals in dq_row_vectors(v, C):
        e(f"sts_v{len(vals)}({sa('sq', 'sqo', (16 * mq + 8 * h) * RS + off)}, {', '.join(vals)})")


def atomic_dq(e, v, C):
    """dq_atomic: add this warp's dQ fragments to the float32 accumulator with red.global.add
    (FA2's scheme: fast, but the summation order, hence the bits, depend on timing)."""
    e(f"# atomic_dq: {C} -> accumulator (red.global.add, unordered)")
    for mq, h, off, vals in dq_row_vectors(v, C):
        if off == 0:   # a new fragment row: its global address
            e(f"rl = cq + qrow + {16 * mq + 8 * h} + g")
            e(f"ok = u32(rl < cols); ab = accp + ((col0 + sel(ok != 0, rl, 0)) * H + hq) * {4 * v.D} + qcol * 4")
        e(f"red_v{len(vals)}_if(ok, ab + {off} + t * {4 * len(vals)}, {', '.join(vals)})")


def dq_passes(v):
    """(passes, rows per pass) of a CTA moving a float32 BN x D block in 16-byte chunks."""
    cpr = v.D // 4
    return v.BN * cpr // v.NT, v.NT // cpr


def fetch_acc(e, v):
    """Wait for this tile's turn at the pending block and start copying its running sum into `sacc`
    (cp.async through L2; zero-filled for the first visitor, who reads nothing, and for tail rows)."""
    RS = v.dq_stage_row()
    n, step = dq_passes(v)
    e("# fetch_acc: the pending block's running dQ sum -> shared sacc (after our turn came)")
    dq_geometry(e, v, "move")
    e("turn = cntp + ((col0 + p_cq) * H + p_hq) * 4")
    # one thread spins (an acquire per thread would cost every warp a fence), the barrier hands
    # the acquire on to the CTA (causality order), then every thread's cp.async reads the sum
    e("wait_eq_if(u32(tx == 0), turn, rank)")
    e("cuda.syncthreads()")
    e("rd = u32(rank > 0)")
    for k in range(n):
        e(f"rr = fr + {k * step}; ok = u32(p_cq + rr < cols) & rd")
        e(f"ga = accp + ((col0 + p_cq + sel(ok != 0, rr, 0)) * H + p_hq) * {4 * v.D} + fc * 16")
        e(f"cp_async16({sa('sacc', 'fo', k * step * RS)}, sel(ok != 0, ga, accp), ok * 16)")
    e("cp_commit()")


def pass_turn(e):
    """after the barrier that ends flush_dq's reads of sq and its stores: thread 0 hands the pending
    block's turn to the next rank (st.release at GPU scope publishes every thread's stores)."""
    e("cuda.syncthreads()")
    e("stg_release_if(u32((tx == 0) & (p_on != 0)), turn, rank + 1)")


def flush_dq(e, v):
    """pending block: running sum + staged dQ -> the float32 accumulator, or (last visitor) dQ =
    scale * total in q's dtype. Coalesced 16-byte rows; tail rows are not written."""
    RS = v.dq_stage_row()
    n, step = dq_passes(v)
    e("# flush_dq: add the staged block to the running sum and store it (or the finished dQ)")
    dq_geometry(e, v, "move")
    e("mid = u32(p_last == 0)")
    if v.tf32:
        e("f = sel(p_last != 0, scale, one)")
    for k in range(n):
        e(f"rr = fr + {k * step}; ok = u32(p_cq + rr < cols); gr = col0 + p_cq + sel(ok != 0, rr, 0)")
        e(f"x0, x1, x2, x3 = lds_f32x4({sa('sq', 'fo', k * step * RS)})")
        e(f"y0, y1, y2, y3 = lds_f32x4({sa('sacc', 'fo', k * step * RS)})")
        e("x0 = x0 + y0; x1 = x1 + y1; x2 = x2 + y2; x3 = x3 + y3")
        e(f"ab = accp + (gr * H + p_hq) * {4 * v.D} + fc * 16; ob = dqp + gr * dq_rs + p_hq * {v.EB * v.D} + fc * {4 * v.EB}")
        if v.tf32:   # dQ is float32: the same 16-byte store, to one buffer or the other
            e("stg_v4_if(ok, sel(p_last != 0, ob, ab), x0 * f, x1 * f, x2 * f, x3 * f)")
            continue
        e("stg_v4_if(ok & mid, ab, x0, x1, x2, x3)")
        e("stg_u32_if(ok & p_last, ob, pack2(x0 * scale, x1 * scale))")
        e("stg_u32_if(ok & p_last, ob + 4, pack2(x2 * scale, x3 * scale))")


# ----------------------------------------------------------------------------- fused dQ on wgmma
# The same scheme with warpgroup products: dS^T leaves the registers (the packed A operands of the
# dK product) as a query-major tile in the wgmma layout (64-key sub-tiles of 128-byte rows), and
# each unit of 64 queries x N columns of dQ is one "st" chain: A = dS rows (K-major), B = the
# resident K tile read MN-major, exactly as O += P V reads V.
def wg_store_ds(e, v, dsb):
    """dS^T (this warp's 16 key rows: key 16 wid + 8 h + g, packed pairs of queries 2t, 2t + 1 in
    sa0_{ks}_{r}) -> the query-major dS tile: query row i, key c at sub-tile c // 64, chunk
    ((c % 64) // 8) ^ (i % 8). A warp's keys sit in one sub-tile (16 wid // 64 = its warpgroup).
    Key rows past the tile are stored as 0 (see store_ds)."""
    e(f"# wg_store_ds: dS^T fragments -> shared dS ({v.BN} queries x {v.BM} keys, wgmma layout)")
    for h in (0, 1):
        e(f"kv{h} = u32(wid * 16 + {8 * h} + g < rows)")
        for q in (0, 1):
            e(f"dso{h}{q} = u32((wid // 4) * {v.BN * 128} + (2 * t + {q}) * 128"
              f" + (((2 * (wid % 4) + {h}) ^ (2 * t + {q})) * 16) + 2 * g)")
    for ks in range(v.BN // 16):
        for r in range(4):   # sa0_{ks}_{r}: key half r % 2, queries 16 ks + 8 (r // 2) + 2t, +1
            h, off = r % 2, (16 * ks + 8 * (r // 2)) * 128
            e(f"sts_halves({sa(dsb, f'dso{h}0', off)}, {sa(dsb, f'dso{h}1', off)}, sel(kv{h} != 0, sa0_{ks}_{r}, u32(0)))")


def wg_dq(e, v, dsb, ktile):
    """dQ of this block, unit by unit (Variant.wg_dq_units): one st chain into dqc, then added with
    red.global (dq_atomic) or staged into the float32 tile sq in natural column order (the ordered
    accumulation's flush_dq adds it one block later)."""
    RG, CG, N, per = v.wg_dq_units()
    nwg, RS = v.NW // 4, v.dq_stage_row()
    # k-step ks: 32 bytes into the dS row's sub-tile ks // 4 (A, K-major); 16 key rows further in K (B)
    steps = [(((ks // 4) * v.BN * 128 + (ks % 4) * 32) >> 4, (ks * 16 * 128) >> 4) for ks in range(v.BM // 16)]
    chain = e.chain("st", N, steps)
    regs = [x for j in range(N // 8) for x in c_regs("dqc", 0, j)]
    e(f"# wg_dq: dQ units of 64 queries x {N} columns = dS . K ({'red.global' if v.dq_atomic else 'staged in sq'})")
    for i in range(per):
        e(f"un = wid // 4 + {nwg * i}; urg = un // {CG}; ucg = un % {CG}")
        e(f"da = {wg_desc(f'a32({dsb}, u32(urg * {64 * 128}))', 16)}")
        e(f"db = {wg_desc(f'a32({ktile}, u32((ucg * {N} // 64) * {v.BM * 128} + (ucg * {N} % 64) * 2))', v.BM * 128)}")
        zero_c(e, "dqc", 1, N // 8)
        e(f"{', '.join(regs)} = {chain}(da, db, {', '.join(regs)})")
        e(f"ur = urg * 64 + (wid % 4) * 16 + g; uc = ucg * {N} + 2 * t")   # this lane's row (h = 0), column
        for h in (0, 1):
            r0, r1 = 2 * h, 2 * h + 1
            if v.dq_atomic:
                e(f"rl = cq + ur + {8 * h}; ok = u32(rl < cols)")
                e(f"ab = accp + ((col0 + sel(ok != 0, rl, 0)) * H + hq) * {4 * v.D} + uc * 4")
                for j in range(N // 8):
                    e(f"red_v2_if(ok, ab + {32 * j}, dqc0_{j}_{r0}, dqc0_{j}_{r1})")
            else:
                e(f"so = u32((ur + {8 * h}) * {RS} + uc * 4)")
                for j in range(N // 8):
                    e(f"sts_v2({sa('sq', 'so', 32 * j)}, dqc0_{j}_{r0}, dqc0_{j}_{r1})")


# ============================================================================= backward: dK, dV
def gen_dkdv(v):
    """dV = sum_i P_ij dO_i, dK = scale * sum_i dS_ij Q_i for one key tile per CTA, all query heads
    of its kv group in order (GQA without atomics). Works on the transposed tile S^T = K Q^T so
    the accumulators are rows of dK/dV; per-column (query) lse2 and Delta come from global."""
    v.check()
    e = Source()
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    rsk, rsv = v.GB * D, v.GB * Dv
    QT, OT = BN * v.row_bytes(D), BN * v.row_bytes(Dv)   # one part of a streamed Q / dO tile
    nt = BN // 8
    fq = v.fuse_dq
    e("def kernel(qp, kp, vp, dop, lsep, dltp, dkp, dvp, " + ("dqp, accp, cntp, " if fq else "")
      + "work, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, do_rs, do_hs, dk_rs, dv_rs, " + ("dq_rs, " if fq else "")
      + "group, H, sc, scale):")
    with e.indent():
        thread_geometry(e, v)
        # work row: rows = this tile's keys, cols = the block's queries, diag = local index of key row 0
        if fq:   # flat grid, heads interleaved (see the fused-dQ notes above)
            e(f"bid = i64(cuda.blockIdx.x); nkvh = {udiv('H', 'group')}; hk = {umod('bid', 'nkvh')}")
            read_work(e, v, udiv("bid", "nkvh"))
            e(f"rank = diag // {v.BM}; ntk = (diag + rows_left + {v.BM - 1}) // {v.BM}")
        else:
            e("hk = i64(cuda.blockIdx.y)")
            read_work(e, v)
        shared_array(e, v)
        shared_base(e, v)
        e("zero = f32(0.0); masked = f32(%r)" % MASKED)
        e(f"wrow = wid * {16 * MT}")
        # causal: queries i >= key j only, so start at the query block holding the first key
        e(f"qb0 = sel(causal != 0, diag // {BN}, 0)")
        e(f"nqb = (cols + {BN - 1}) // {BN}")
        # query blocks with no masked entry: causal ones strictly below every key of the tile,
        # and none past the tail
        e(f"qfull = sel(causal != 0, (diag + rows + {BN - 1}) // {BN}, 0)")
        e(f"qlast = cols // {BN}")
        where, kept, off = resident(e, v, [("ka", "kp + row0 * k_rs + hk * k_hs", "k_rs", D),
                                           ("va", "vp + row0 * v_rs + hk * v_hs", "v_rs", Dv)], "wrow")
        e(f"ss = {sa('sb', off) if off else 'sb'}")
        if fq:
            e(f"dsb = a32(ss, {2 * (QT + OT)}); sq = a32(dsb, {v.ds_tile_bytes()}); "
              f"sacc = a32(sq, {v.BN * v.dq_stage_row()})")
            # the block whose dQ is staged in sq and not yet added (one step behind)
            e("p_on = 0; p_hq = i64(0); p_cq = i64(0); p_last = u32(0); turn = cntp")
        # key j may see query i when i_local >= j_local: column limit from below
        for m in range(MT):
            for h in (0, 1):
                e(f"kl{m}{h} = diag + wrow + {16 * m + 8 * h} + g")
        zero_c(e, "dk", MT, D // 8)
        zero_c(e, "dv", MT, Dv // 8)
        qbuf = lambda b: f"qbuf_{b}"  # noqa: E731
        obuf = lambda b: f"obuf_{b}"  # noqa: E731
        qo = StreamedPair(e, v, ("q", "o"), (D, Dv))
        block_at = lambda c, h: [(f"qp + (col0 + {c}) * q_rs + {h} * q_hs", "q_rs", f"cols - {c}"),  # noqa: E731
                                 (f"dop + (col0 + {c}) * do_rs + {h} * do_hs", "do_rs", f"cols - {c}")]
        e("nit = (nqb - qb0) * group")   # flattened (head, query block) loop: one pipeline across heads
        e("if nit > 0:")
        with e.indent():
            e("hq = hk * group")
            e(f"c1 = qb0 * {BN}")
            qo.load("0", block_at("c1", "hq"))
            e("cp_commit()")
        e("for it in range(nit):")
        with e.indent():
            qo.current("it")
            e(f"nqc = nqb - qb0; hq = hk * group + {udiv('it', 'nqc')}; qb = qb0 + {umod('it', 'nqc')}")
            e("if it + 1 < nit:")
            with e.indent():
                e(f"hn = hk * group + {udiv('(it + 1)', 'nqc')}; c1 = (qb0 + {umod('(it + 1)', 'nqc')}) * {BN}")
                qo.prefetch(block_at("c1", "hn"))
            qo.last()
            e(f"cq = qb * {BN}")
            landed(e, v)
            if fq and not v.dq_atomic:   # the previous block's turn: fetch its running sum while this block computes
                e("if p_on != 0:")
                with e.indent():
                    fetch_acc(e, v)
            zero_c(e, "s", MT, nt)
            mma_abt(e, v, "s", "ka", qbuf("cur"), nt, D, where["ka"])
            if v.wg_async:   # dP^T = V dO^T runs while S^T is masked and exponentiated
                zero_c(e, "dp", MT, nt)
                mma_abt(e, v, "dp", "va", obuf("cur"), nt, Dv, where["va"], wait=False)
            e("if (qb < qfull) | (qb >= qlast):")
            with e.indent():
                for m in range(MT):
                    for j in range(nt):
                        for r in range(4):
                            x = f"s{m}_{j}_{r}"
                            e(f"ci = cq + {8 * j + r % 2} + 2 * t")
                            e(f"{x} = sel((ci < cols) & ((causal == 0) | (ci >= kl{m}{r // 2})), {x}, masked)")
            # per-column (query) statistics, loaded where used (short live ranges; masked
            # columns read nothing): lse2 for P, then Delta for dS
            # (overlapped with dP: tile by tile, so that few are live next to the in-flight dP)
            for tiles in ([[j] for j in range(nt)] if v.wg_async else [range(nt)]):
                col_stats(e, tiles, "cl", "lsep")
                for m in range(MT):
                    for j in tiles:
                        for r in range(4):
                            x = f"s{m}_{j}_{r}"
                            e(f"{x} = ex2({x} * sc - cl{j}{r % 2})")
            def to_ds(m, tiles):   # dS = P (dP - Delta), in place
                for j in tiles:
                    for r in range(4):
                        e(f"s{m}_{j}_{r} = s{m}_{j}_{r} * (dp{m}_{j}_{r} - cd{j}{r % 2})")
            if v.wg_async:
                # P's A operands are packed k-step by k-step and each k-step's P turns into dS right
                # after (dP dies as P is packed: no more registers live than before); then dV += P^T dO
                # (16-bit: issued, it runs while dS is packed for dK; split: its per-block partials
                # need the result at once) and dK += dS^T Q
                wg_wait(e, 0, "dp", nt)
                col_stats(e, range(nt), "cd", "dltp")
                wg_pack(e, v, "pa", "s", BN // 16, lambda ks: to_ds(0, (2 * ks, 2 * ks + 1)))
                mma_pb(e, v, "dv", "pa", "s", obuf("cur"), Dv // 8, BN, Dv, wait=v.split, packed=True)
            else:
                mma_pb(e, v, "dv", "pa", "s", obuf("cur"), Dv // 8, BN, Dv)
                zero_c(e, "dp", MT, nt)
                mma_abt(e, v, "dp", "va", obuf("cur"), nt, Dv, where["va"])
                col_stats(e, range(nt), "cd", "dltp")
                for m in range(MT):
                    to_ds(m, range(nt))
            mma_pb(e, v, "dk", "sa", "s", qbuf("cur"), D // 8, BN, D)
            if v.wg_async and not v.split:   # dV: completed by the dK chain's wait, handed back here
                wg_wait(e, 0, "dv", Dv // 8)
            if fq and v.wgmma:
                wg_store_ds(e, v, "dsb")
                if not v.dq_atomic:
                    e("if p_on != 0:")
                    with e.indent():
                        e("cp_wait0()")
                landed(e, v)   # dS (for the async proxy) and the fetched running sum are visible
                if not v.dq_atomic:   # add the previous block, pass its turn on, then this block's dQ into sq
                    e("if p_on != 0:")
                    with e.indent():
                        flush_dq(e, v)
                    pass_turn(e)
                wg_dq(e, v, "dsb", kept["ka"])
            elif fq:
                store_ds(e, v, "dsb")
                if not v.dq_atomic:
                    e("if p_on != 0:")
                    with e.indent():
                        e("cp_wait0()")
                e("cuda.syncthreads()")   # dS and the fetched running sum are visible to every warp
                if not v.dq_atomic:
                    e("if p_on != 0:")
                    with e.indent():
                        flush_dq(e, v)
                mma_dq(e, v, "dqc", "qs", "dsb", kept["ka"])
                if v.dq_atomic:
                    atomic_dq(e, v, "dqc")
            if fq and not v.dq_atomic:
                if not v.wgmma:
                    pass_turn(e)
                    stage_dq(e, v, "dqc")
                e(f"nvis = sel(causal != 0, imin(ntk, ((qb + 1) * {BN} - 1) // {v.BM} + 1), ntk)")
                e("p_on = 1; p_hq = hq; p_cq = cq; p_last = u32(rank + 1 == nvis)")
            e("cuda.syncthreads()")
        if fq and not v.dq_atomic:   # the last block's dQ is still staged
            e("if p_on != 0:")
            with e.indent():
                fetch_acc(e, v)
                e("cp_wait0(); cuda.syncthreads()")
                flush_dq(e, v)
                e("cuda.syncthreads()")
                e("stg_release_if(u32(tx == 0), turn, rank + 1)")
        store_c_rows(e, v, "dk", D // 8, f"dkp + row0 * dk_rs + hk * {rsk}", "dk_rs", "wrow", "rows",
                     lambda m, h: "scale")
        store_c_rows(e, v, "dv", Dv // 8, f"dvp + row0 * dv_rs + hk * {rsv}", "dv_rs", "wrow", "rows",
                     lambda m, h: "one")
    return e.text().replace("    zero = f32(0.0); masked", "    one = f32(1.0); zero = f32(0.0); masked", 1)


# ============================================================================= backward: Delta pre-pass
def gen_delta(dtype, Dv):
    """Delta_i = sum_d dO_id O_id and lse2_i = m_i log2(e) + log2(l_i) (0 for empty rows), one warp
    per (row, head): the per-row inputs of both backward kernels."""
    e = Source()
    e("def kernel(op, dop, mp, lp, dltp, lsep, n, H, o_rs, o_hs, do_rs, do_hs):")
    with e.indent():
        e("tx = i64(cuda.threadIdx.x); lane = tx % 32")
        e("rh = i64(cuda.blockIdx.x) * (i64(cuda.blockDim.x) // 32) + tx // 32")
        # predicated rather than branched: every lane takes part in the shuffles
        e("live = u32(rh < n * H); rh = sel(live != 0, rh, 0)")
        e("row = rh // H; hh = rh % H")
        e("acc = f32(0.0)")
        per_word = 1 if dtype == "float32" else 2   # elements per 32-bit load
        for c in range((Dv // per_word + 31) // 32):
            e(f"d = lane + {32 * c}; ok = live & u32(d < {Dv // per_word})")
            if per_word == 1:
                e("x0 = ldg_f32_if(ok, op + row * o_rs + hh * o_hs + d * 4)")
                e("y0 = ldg_f32_if(ok, dop + row * do_rs + hh * do_hs + d * 4)")
                e("acc = acc + x0 * y0")
                continue
            e("x0, x1 = unpack2(ldg_u32_if(ok, op + row * o_rs + hh * o_hs + d * 4))")
            e("y0, y1 = unpack2(ldg_u32_if(ok, dop + row * do_rs + hh * do_hs + d * 4))")
            e("acc = acc + x0 * y0 + x1 * y1")
        for s in (16, 8, 4, 2, 1):
            e(f"acc = acc + shfl_xor(acc, {s})")
        e("ll = ldg_f32_if(live, lp + rh * 4); mm = ldg_f32_if(live, mp + rh * 4)")
        e("ls = sel(ll > f32(0.0), mm * f32(%r) + log2f(sel(ll > f32(0.0), ll, f32(1.0))), f32(0.0))" % LOG2E)
        e("ok = live & u32(lane == 0)")
        e("stg_f32_if(ok, dltp + rh * 4, acc)")
        e("stg_f32_if(ok, lsep + rh * 4, ls)")
    return e.text()


GENERATORS = {"fwd": gen_forward, "dq": gen_dq, "dkdv": gen_dkdv}


def gen_source(v):
    return GENERATORS[v.kind](v)
