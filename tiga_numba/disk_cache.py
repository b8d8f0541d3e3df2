"""Where compiled kernels and generated kernel sources are kept between processes.

One root folder, ``$TIGA_NUMBA_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tiga_numba``, else
``~/.cache/tiga_numba``), with one sub-folder per producer:

    cuda/      cubins of the CUDA-core kernels (cuda/launch.py)
    tc/        generated tensor-core kernel texts and their cubins (cuda/tc/build.py)
    gat/       generated score-network kernel modules, CPU and CUDA (cpu/gat.py, cuda/gat.py)

A cubin is kept as one record file (`write_cubin` / `read_cubin`: the entry name, a newline,
the cubin), the format both cubin producers share.

``TIGA_NUMBA_CACHE_DIR=0`` (or empty) turns the caches off: cubins are compiled in every
process. Generated modules must still be imported from a file (numba's own cache and the
import system want one), so they go to a private temporary folder instead. The variable is
read at each call, so a test or a deployment can point it elsewhere at any time.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile

__all__ = ["root", "folder", "module_folder", "import_source", "read_cubin", "write_cubin", "holds",
           "publish"]


def root():
    """The cache root, or None when caching is off (TIGA_NUMBA_CACHE_DIR = "0" or "")."""
    d = os.environ.get("TIGA_NUMBA_CACHE_DIR")
    if d is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "tiga_numba")
    return None if d in ("", "0") else d


def folder(name):
    """The path of sub-folder `name` of the cache root (not created), or None when caching is off."""
    r = root()
    return None if r is None else os.path.join(r, name)


def module_folder(name):
    """An existing folder for generated modules: sub-folder `name` of the cache root, or a
    private temporary folder when caching is off or the root cannot be written (no reuse
    across processes then, but the import still works)."""
    path = folder(name)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
            if os.access(path, os.W_OK | os.X_OK):   # an existing read-only folder: not usable
                return path
        except OSError:
            pass
    return tempfile.mkdtemp(prefix=f"tiga_numba_{name}_")


def import_source(source, prefix, name):
    """Import generated Python `source` as module `{prefix}_{digest}` from a file in
    module_folder(name), written once per digest (atomically: concurrent processes never see
    half a file). A real file lets numba's on-disk cache (cache=True) serve generated code too;
    the digest in the module name means a changed text is never served from an old file."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    modname = f"{prefix}_{digest}"
    if modname in sys.modules:
        return sys.modules[modname]
    path = os.path.join(module_folder(name), modname + ".py")
    if not holds(path, source):   # missing, or damaged (cut short, emptied): written again
        try:
            publish(path, source)
        except OSError:   # the folder cannot be written after all: a private one
            path = os.path.join(tempfile.mkdtemp(prefix=f"tiga_numba_{name}_"), modname + ".py")
            publish(path, source)
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[modname] = module
    return module


def holds(path, text):
    """Whether the file at `path` holds exactly `text` (a file of another text under the digest's
    name is a damaged one: it is never imported)."""
    try:
        with open(path) as fh:
            return fh.read() == text
    except (OSError, UnicodeDecodeError):
        return False


def publish(path, data):
    """Write `data` (str or bytes) to `path` atomically: a temporary file, then one rename, so
    a reader in another process sees the whole file or none."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)
    os.replace(tmp, path)


def read_cubin(path):
    """(entry name, cubin bytes) from a cache record written by write_cubin, or None (no path,
    no file, or anything that is not such a record: an older cache layout counts as a miss)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            entry, _, data = fh.read().partition(b"\n")
    except OSError:
        return None
    if not entry or data[:4] != b"\x7fELF":
        return None
    return entry.decode("ascii", "replace"), data


def write_cubin(path, entry, data):
    """Store one cache record: the entry name, a newline, the cubin, published with one rename.
    One file, not a cubin plus an entry file: the entry name holds a per-process counter of
    numba's, so two processes compiling the same kernel could otherwise pair one's entry name
    with the other's cubin. Best effort: an unwritable cache only means compiling again."""
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        publish(path, entry.encode() + b"\n" + data)
    except OSError:
        pass
