"""Exceptions shared by the argument checks.

The contract's error rules (docs/design.md, "Errors") sort bad input into TypeError (wrong
type or dtype) and ValueError (bad values). Some inputs fall under both rules; their exception
is both, so that code catching either sees it, as numpy's AxisError is both a ValueError and
an IndexError."""


class TypeAndValueError(TypeError, ValueError):
    """Bad input that is both of the wrong type (or dtype) and a bad value."""


class ThresholdTypeError(TypeAndValueError):
    """A block_prune_threshold that is not a real number: a TypeError as Python has it, and a
    ValueError as the contract's "0 < rho <= 1 (ValueError otherwise)" has it."""


class IndexDtypeError(TypeAndValueError):
    """An index array (offsets, lengths, indices, sources, destinations) of a float or other
    non-integer dtype: an unsupported dtype (TypeError) and a bad CSR / cu_seqlens
    (ValueError)."""
