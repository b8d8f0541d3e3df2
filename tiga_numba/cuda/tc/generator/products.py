"""The two products every kernel is built from, on either engine: C = A B^T (`mma_abt`, S = Q K^T
and its backward twins) and C += P B (`mma_pb`, O += P V, dQ += dS K, ...), plus the resident
operand of a CTA (`resident`). mma.sync fragments or wgmma chains, as the Variant says."""
from __future__ import annotations

from .fragments import a_regs, c_regs, c_to_a, c_to_a_tf32, ldsm_a, load_a, mma, split_tf32, zero_c_tiles
from .shared import convert_tile, landed, load_tile, sa, stage_tile
from .variant import PB_PAIRS
from .wgmma import wg_abt, wg_pb


def mma_abt(e, v, C, A, btile, ntiles, width, a_smem=None, wait=True, swap=False):
    """C[m][j] += A[m] . B^T with B row-major [n][k] in shared memory (K for S = Q K^T), k = `width`
    elements. a_smem = (tile, row0): A is read from that shared tile per k-step pair instead of
    registers. One ldmatrix.x4 gives the B fragments of two k-steps (either dtype). wait=False
    (wgmma only): issued, C is read after wg_wait. swap (float32 splits): the product is the
    transpose of one computed elsewhere (S^T = K Q^T of S = Q K^T); its part products run with
    the operands' roles swapped, so every element sums the same part products in the same order
    and gets the same bits (the backward's P must see the forward's scores exactly)."""
    if v.wgmma:
        wg_abt(e, v, C, btile, ntiles, width, a_smem[0], wait, swap)
        return
    assert wait, "mma.sync products complete in order"
    MT, rs, ksteps = v.MT, width * v.EB, v.ksteps(width)

    def one(j, kp):
        e(f"b0, b1, b2, b3 = ldsm_x4({sa(btile, f'xb{rs}_{kp}', j * 8 * rs)})")
        split_tf32(e, v, ["b0", "b1", "b2", "b3"])
        for kk, b in enumerate((["b0", "b1"], ["b2", "b3"])):
            for m in range(MT):
                mma(e, v, c_regs(C, m, j), a_regs(v, A, m, 2 * kp + kk), b, swap)
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
