"""The kernel-text builder: `Source` collects lines with indentation and the module-level wgmma
intrinsics a kernel calls; `udiv` / `umod` / `_tree` write unsigned division and balanced
reduction expressions."""
from __future__ import annotations


# ----------------------------------------------------------------------------- source writer
class Source:
    """the kernel text: `def kernel` and, before it, the module-level lines that make the wgmma
    intrinsics it calls (chain(), wait())."""

    def __init__(self):
        self.lines, self.ind, self.prelude, self.made = [], 0, [], {}
        # values a score modifier computed once for a fragment row / column position and named
        # for the rest of the text (modifier.Modifier.cell): (role, position) -> names
        self.named = {}

    def chain(self, form, N, steps, wait=True):
        """the name of a wgmma chain intrinsic (ptx.wgmma_chain(form, N, steps[, wait])), made once per text."""
        return self._made(f"wgmma_chain({form!r}, {N}, {tuple(steps)!r}" + ("" if wait else ", False") + ")")

    def wait(self, n, count):
        """the name of ptx.wgmma_wait(n, count), made once per text."""
        return self._made(f"wgmma_wait({n}, {count})")

    def uses_barriers(self):
        """the text calls the mbarrier / named-barrier intrinsics of barriers.py."""
        from .. import barriers
        self._imports(barriers.prelude_line())

    def uses_copies(self):
        """the text calls the small cp.async copies of copies.py."""
        from .. import copies
        self._imports(copies.prelude_line())

    def uses_clamps(self):
        """the text calls the one-bound clamp of clamps.py."""
        from .. import clamps
        self._imports(clamps.prelude_line())

    def _imports(self, line):
        """an intrinsics module's prelude line, once per text (the line carries that module's
        digest, so the cubin key covers the module)."""
        if line not in self.prelude:
            self.prelude.insert(0, line)

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
