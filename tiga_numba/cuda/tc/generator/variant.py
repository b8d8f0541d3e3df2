"""The compile-time constants of one tensor-core kernel (`Variant`: kind, head dims, dtype, warps,
m16 tiles per warp, key-block width, engine, fusion, pruning) and the numeric policy every
kernel shares (masking value, TF32 / bf16-split passes, per-block partials). A Variant derives
its tile geometry and shared-memory plan; nothing here writes kernel text."""
from __future__ import annotations

from dataclasses import dataclass


LOG2E = 1.4426950408889634
#: raw score given to masked (non-)edges: finite, so fast-math cannot fold it, and far below
#: any real score so exp2 of (masked * scale - max) underflows to 0
MASKED = -1.0e30

#: shared memory a CTA may use on sm_90 (227 KB); above 48 KB it is dynamic
MAX_SMEM = 227 * 1024

#: work-table row: int32 fields, one row per CTA (schedule.py writes them)
WORK_FIELDS = ("row0", "rows", "col0", "cols", "diag", "causal", "lo", "hi")

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
    overlap: bool = True  # wgmma: chains issued without waiting run while the CUDA cores work. The
    #                       forward (16-bit, no pruning: fwd_pipelined) multiplies P V of block j - 1
    #                       during the softmax of block j; the backward's dP chain (and, 16-bit
    #                       dK/dV, the dV chain) runs while the CUDA cores make P (dS). False: every
    #                       chain waits at once (the A/B baselines of bench_wgmma.py / bench_tc_bwd.py)
    mod: object = None    # a score modifier (modifier.Modifier) compiled into the score cells
    pingpong: bool = False  # the pipelined forward's two warpgroups (NW = 8) take turns on the
    #                         tensor cores (named barriers), each running its softmax while the other
    #                         one's chains run, fed by an mbarrier ring instead of CTA barriers
    #                         (forward.py); where the loop is not pipelined or NW != 8 (pruning, the
    #                         narrow-band shape) it has no effect, as overlap has none there (pingpong_loop)
    ring_v_slots: int = 0   # pingpong: V slots of the ring (2 or 3); 0: three where they fit in shared memory
    stats_smem: bool = True  # 16-bit two-kernel wgmma dK/dV (with or without a modifier): each query block's
    #                          per-query statistics ((m2, log2 l), Delta) are copied to shared memory with
    #                          its Q / dO tiles (copies.py, the same commit group) and read there, instead
    #                          of loaded from global memory once S^T is done (see stats_in_smem); the
    #                          backward took 0.74-0.93x the time of the loads from global memory on the
    #                          H100 (results/hopper-h100-2026-12-06b.txt §1; modified kernels: -06c.txt)
    col_parts: int = 1    # dkdv, 16-bit wgmma: a CTA keeps 1 / col_parts of the dK and dV columns (grid z
    #                       picks which) and recomputes S^T and dP^T for its part: at D = 256, dK and dV
    #                       of 64 keys x 256 columns would take 256 accumulator registers per thread

    @property
    def wg_async(self):
        """the wgmma backward overlaps chains with CUDA-core work (overlap)."""
        return self.wgmma and self.overlap

    @property
    def fwd_pipelined(self):
        """the forward's software pipeline (forward.pipelined_key_blocks): S = Q K^T of block j and
        O += P V of block j - 1 are issued back to back, and the softmax of block j runs while the
        tensor cores multiply P V. 16-bit wgmma only: split P B products add per-block partials
        right after their chain, and a pruned block's skipped P V would change the chain count
        that the waits count on."""
        return self.kind == "fwd" and self.wg_async and not self.split and not self.prune

    @property
    def pingpong_loop(self):
        """the forward's key loop runs the ping-pong schedule (pingpong, where it applies)."""
        return self.pingpong and self.fwd_pipelined and self.NW == 8

    def stats_streamable(self):
        """the kernels stats_smem applies to: 16-bit two-kernel wgmma dK/dV kernels."""
        return self.kind == "dkdv" and self.wgmma and not (self.split or self.fuse_dq)

    @property
    def stats_in_smem(self):
        """the dK/dV kernel streams its blocks' statistics through shared memory (stats_smem where
        it applies): a load from global after S^T costs an L2 round trip per block on the critical
        path; the copy lands a block early, with the tiles."""
        return self.stats_smem and self.stats_streamable()

    def stats_slot_bytes(self):
        """one block's statistics in shared memory: BN (m2, log2 l) pairs, then BN Delta values."""
        return 12 * self.BN if self.stats_in_smem else 0

    @property
    def k_slots(self):
        """K (or streamed A-side) blocks in shared memory at once."""
        return self.stream_buffers

    @property
    def v_slots(self):
        """V blocks in shared memory at once. The ping-pong ring keeps three where they fit, so that
        the slot V of block j is copied into was last read by P V of block j - 3, which every
        warpgroup finished an iteration earlier; with two (D = 256), a warpgroup may wait there for
        the other one's P V of block j - 2 (forward.pipelined_key_blocks)."""
        if not self.pingpong_loop:
            return self.stream_buffers
        return self.ring_v_slots or (3 if self._smem_bytes(3) <= MAX_SMEM else 2)

    def _ring_barriers(self, v_slots):
        """ping-pong ring: mbarriers (8 bytes each) after the streamed slots: full[2] (a block's
        copies landed), emptyK[2] (S of a K slot done), emptyV[v_slots] (P V of a V slot done)."""
        return 4 + v_slots if self.pingpong_loop else 0

    @property
    def ring_barriers(self):
        return self._ring_barriers(self.v_slots)

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
        if self.mod is not None and (self.prune or self.fuse_dq or self.wg_async and self.kind != "fwd"):
            raise ValueError("a score modifier runs in the forward (no pruning) and the two-kernel "
                             "backward without overlap (overlap=False): its f'(z) is taken with P")
        if self.mod is not None and self.mod.split is not None and self.kind != "fwd":
            raise ValueError("a score modifier's Split (an ordered relation's distances) is the forward's: "
                             "the backward kernels take the modifier without `ordered`")
        if self.dq_atomic and not self.fuse_dq:
            raise ValueError("dq_atomic needs fuse_dq")
        if self.col_parts != 1:
            sub = 128 // self.EB   # columns of one 128-byte sub-tile: a part starts on one
            if (self.kind != "dkdv" or not self.wgmma or self.split or self.fuse_dq or self.col_parts < 1
                    or any(d % (self.col_parts * sub) for d in (self.D, self.Dv))):
                raise ValueError(f"col_parts = {self.col_parts}: a 16-bit wgmma dK/dV kernel (no fused dQ) whose "
                                 f"head dims split into parts of whole {sub}-column sub-tiles")
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
            from ..ptx import WGMMA_N
            # products: S-like (N = BN, or the keys of dK/dV's S^T) and P B-like (N = D or Dv; split:
            # per pb_cols-column group)
            for n in [self.BN] + [n for w in (self.D, self.Dv) for n in pb_groups(self, w // self.col_parts)]:
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

    def stream_bytes(self, v_slots=None):
        """every streamed slot: k_slots K blocks and v_slots V blocks (all parts)."""
        v_slots = self.v_slots if v_slots is None else v_slots
        return self.parts * self.BN * (self.k_slots * self.row_bytes(self.D) + v_slots * self.row_bytes(self.Dv))

    def ring_offset(self):
        """pingpong: the first byte of the ring's mbarriers (after the resident and streamed tiles)."""
        return self.resident_bytes() + self.stream_bytes()

    def staging_bytes(self):
        """split: the float32 staging tile (cp.async lands there, stage_tile / convert_tile), large
        enough for a streamed block and for each resident tile."""
        if not self.split:
            return 0
        return 4 * max(self.BN * (self.D + self.Dv), self.BM * max(self.resident_widths()))

    def staging_offset(self):
        """split: where the staging tile starts (after the resident and streamed tiles)."""
        return self.resident_bytes() + self.stream_bytes()

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
        return self._smem_bytes(self.v_slots)

    def _smem_bytes(self, v_slots):
        """shared bytes with `v_slots` V slots (v_slots decides between three and two this way)."""
        w = self.resident_widths()
        staged = [w[i] for i in range(len(w)) if i not in self.kept_in_shared()]
        staging = self.BM * max(self.row_bytes(x) for x in staged) if staged else 0   # register mode: staged once
        return (self.resident_bytes() + max(self.stream_bytes(v_slots), staging) + 8 * self._ring_barriers(v_slots)
                + 2 * self.stats_slot_bytes()
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
        from ..ptx import WGMMA_N
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
                + (f"_cp{self.col_parts}" if self.col_parts != 1 else "")
                + ("_gs" if self.stats_streamable() and not self.stats_smem else "") + ("_pr" if self.prune else "") + (("_pp" if self.v_slots == 3 else f"_pp{self.v_slots}") if self.pingpong_loop else "") + (f"_m{self.mod.digest}" if self.mod is not None else ""))


def pb_groups(v, width):
    """column groups of a P B product with `width` output columns, one wgmma chain each: the whole
    width, or (split) groups of v.pb_cols columns, each accumulated per block in fresh partials
    (PB_PAIRS's reason: the fp32 accumulation truncates) and added to the accumulator with an fp32 add."""
    if not v.split:
        return [width]
    n = v.pb_cols
    return [n] * (width // n) + ([width % n] if width % n else [])
