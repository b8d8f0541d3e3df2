"""Fixes for the installed numba-cuda, applied only where its code still needs them.

* ``numpy.row_stack``: numba-cuda 0.30 still references it and numpy 2.5 removed it; the
  alias is restored before anything imports numba.cuda (``restore_numpy_row_stack``).
* A quadratic lowering pass: numba-cuda's ``Lower._find_singly_assigned_variable`` (a copy of
  numba core's from before numba fixed it) scans every assignment of a block once per variable
  defined there. The generated tensor-core kernels become long straight-line blocks once numba
  has inlined their intrinsics, so that pass took a fifth to three fifths of a kernel's compile
  (benchmarks/results/compile-time-zen4-2core-2026-12-06.txt: the float16 D = 128 wgmma forward
  37 s against 24 s with the fix, the bfloat16 D = 64 one 57 s against 22 s, the float16 D = 128
  dK/dV kernel 14.5 s against 11.6 s, the same PTX).
  ``install`` replaces it with numba core's linear form (assignments counted once per block),
  which computes the same set; numba-cuda versions that have the linear form, or no such
  method, are left alone. It only speeds the compile up: whatever goes wrong while installing
  it leaves numba-cuda as it is.
"""
from __future__ import annotations

from collections import defaultdict

_installed = False
#: numba-cuda's own method, where ``install`` replaced it (None otherwise)
replaced = None


def restore_numpy_row_stack():
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def _singly_assigned_variables(lower):
    """numba core's linear form of the pass: the variables defined once, in one block, used only
    there (and not kept in an alloca), with their assignment counts taken once per block."""
    from numba.cuda.core import ir
    from numba.cuda.core.analysis import compute_use_defs, must_use_alloca
    blocks = lower.func_ir.blocks
    found = set()
    if not lower.func_ir.func_id.is_generator:
        use_defs = compute_use_defs(blocks)
        alloca_vars = must_use_alloca(blocks)
        defined_in = defaultdict(set)
        for block, names in use_defs.defmap.items():
            for name in names:
                defined_in[name].add(block)
        used_in = defaultdict(set)
        for block, names in use_defs.usemap.items():
            for name in names:
                used_in[name].add(block)
        assigns = {}   # block -> {target name: assignments in the block}
        for name, where in defined_in.items():
            if name in alloca_vars or len(where) != 1 or used_in[name]:
                continue
            [block] = where
            if block not in assigns:
                counts = assigns[block] = defaultdict(int)
                for stmt in lower.blocks[block].find_insts(ir.assign_types):
                    counts[stmt.target.name] += 1
            if assigns[block][name] == 1:
                found.add(name)
    return found


def _fast_find_singly_assigned_variable(self):
    self._singly_assigned_vars = _singly_assigned_variables(self)
    self._blk_local_varmap = {}


def _has_quadratic_pass(method):
    """True for numba-cuda's per-variable rescan (it keeps the matches of each scan in a local
    named `assigns`); numba core's linear form counts per block instead."""
    names = getattr(getattr(method, "__code__", None), "co_varnames", ())
    return "assigns" in names and "num_assigns_by_defblk_and_var" not in names


def install():
    """Put the linear pass in place of numba-cuda's quadratic one (once per process; nothing when
    numba-cuda is missing or already has the linear form). Call before compiling a kernel."""
    global _installed, replaced
    if _installed:
        return
    _installed = True
    try:
        from numba.cuda import lowering
        from numba.cuda.core import analysis, ir
    except Exception:   # noqa: BLE001 - no numba-cuda (or the simulator): nothing to fix
        return
    method = getattr(lowering.Lower, "_find_singly_assigned_variable", None)
    needs = (hasattr(ir, "assign_types") and hasattr(analysis, "compute_use_defs")
             and hasattr(analysis, "must_use_alloca"))
    if method is None or not needs or not _has_quadratic_pass(method):
        return
    replaced = method
    lowering.Lower._find_singly_assigned_variable = _fast_find_singly_assigned_variable
