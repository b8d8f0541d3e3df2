"""Tile shapes of the CPU block kernels: chosen from the machine, recorded in the plan.

A forward tile is BM query rows x BN keys: a product for the scores (BM x D x BN), the softmax
over the (BM, BN) score tile, a product for the values (BM x BN x Dv) (blocks.py walks it in
strips of rows; the K / V tiles are what the query rows of a tile share). Larger tiles
amortise the per-tile work (BLAS call, row max / rescale passes) and run the gemms at a larger
fraction of the machine's sgemm rate, as long as the score tile and the K / V tiles stay in the
core's L2 cache. Measured on a 2-core AMD EPYC (Zen 3, 512 KiB L2 per core), N=4096, H=4,
D=64, float32: 64x128 tiles ran the dense forward at 63 GFLOP/s, 256x256 at 87 (numpy sgemm:
109); the backward 612 -> 438 ms (benchmarks/results/cpu-tiles-2core-2026-12-02.txt).

The rule: the largest T in (256, 128, 64) whose float32 score tile T x T takes at most half of
one core's L2, and BM = BN = T; the forward over a dense relation (every block full: no
diagonal tiles to waste) takes BM = 2 T, so each K / V tile serves twice as many query rows
(same box, dense forward: 227 -> 175 ms; on causal relations 2T rows were slower, 115 -> 123). The L2 size is read from Linux's sysfs (fallback: 256 KiB,
which gives 128 x 128). ``tg.options(cpu_tiles=(BM, BN))`` or ``TIGA_NUMBA_CPU_TILES=BMxBN``
overrides it; every choice gives the same results within rounding (tests run several).

Tile pruning keeps fixed 64 x 128 tiles: the tile is the unit of its admission rule, so an
approximate result must not depend on the machine it was computed on.
"""
from __future__ import annotations

import os

__all__ = ["PRUNE_TILES", "machine_tiles", "choose"]

PRUNE_TILES = (64, 128)
_FALLBACK_L2 = 256 * 1024
_MACHINE = []   # memo: [(BM, BN, reason)]


def _l2_bytes():
    """One core's L2 size from sysfs (None where it cannot be read)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            d = os.path.join(base, entry)
            with open(os.path.join(d, "level")) as fh:
                if fh.read().strip() != "2":
                    continue
            with open(os.path.join(d, "size")) as fh:
                text = fh.read().strip().upper()
            mult = {"K": 1024, "M": 1024 ** 2}.get(text[-1], 1)
            return int(text.rstrip("KM")) * mult
    except (OSError, ValueError):
        return None
    return None


def machine_tiles():
    """(BM, BN, reason) of the rule on this machine, computed once."""
    if not _MACHINE:
        l2 = _l2_bytes()
        size = l2 if l2 else _FALLBACK_L2
        T = 64
        for t in (256, 128):
            if 4 * t * t <= size // 2:
                T = t
                break
        where = f"L2 {size // 1024} KiB per core" + ("" if l2 else " (not readable: assumed)")
        _MACHINE.append((T, T, f"rule: {where}"))
    return _MACHINE[0]


#: the narrow side of a narrow band's tiles (a band no wider than twice the machine's tile BN):
#: the forward takes BAND_SIDE query rows x (2 BN + BAND_SIDE) keys, one key tile spanning each
#: query tile's band; the backward BAND_SIDE keys x (2 BN + BAND_SIDE) query rows, one query tile
#: spanning each key tile's band. Square tiles of W keys would spend most of their cells outside
#: the band; a span tile computes only the span (a tile ends at the band's last key / row, and
#: starts at its first: blocks read in place, api._tiles), and one width per machine serves
#: every narrow band. Measured on a 2-core Zen 5 box (N=4096, H=4, D=64, W=256, float32;
#: results/mods-cpu-zen5-2core-2026-12-02.txt): square 64 x 128 tiles forward 9.0-10.9 ms,
#: backward 27.2-29.2 ms; span tiles 8.1-9.9 ms, 23.4-23.5 ms (256 x 256: 19.1 ms forward).
BAND_SIDE = 64


def choose(options, prune, full=False, band_width=None, forward=False):
    """(BM, BN, reason) for a call made with run `options`; `full`: a forward over a relation
    whose blocks are all full (Graph.dense); `band_width`: the widest band of a banded relation
    (keys per row, None when some block is not a narrow band); `forward`: tiles of a forward
    (else of a backward)."""
    if prune:
        return PRUNE_TILES + ("fixed tiles of the pruning rule",)
    tiles = getattr(options, "cpu_tiles", None)
    if tiles is not None:
        return tuple(tiles) + ("options.cpu_tiles",)
    BM, BN, why = machine_tiles()
    if band_width is not None and band_width <= 2 * BN:
        span = 2 * BN + BAND_SIDE
        if forward:
            return BAND_SIDE, span, (f"band of {band_width} keys <= 2 x BN={BN}: one key tile "
                                     "spanning each query tile's band")
        return span, BAND_SIDE, (f"band of {band_width} keys <= 2 x BN={BN}: one query tile "
                                 "spanning each key tile's band")
    if full:
        return 2 * BM, BN, why + "; full blocks: twice the query rows"
    return BM, BN, why
