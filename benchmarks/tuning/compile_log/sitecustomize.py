"""Log every numba compilation of a process (and of its subprocesses, e.g. pytest-xdist workers):
put this folder first on PYTHONPATH and name a log file; each compile (or disk-cache load) appends
one line "pid, start, end, module.function, signature". Summarise with compile_log/summary.py.

    PYTHONPATH=benchmarks/tuning/compile_log:$PWD COMPLOG=/tmp/compile.tsv python -m pytest ...
    python benchmarks/tuning/compile_log/summary.py /tmp/compile.tsv
"""
import os
import time

try:
    from numba.core import event as _event

    class _Log(_event.Listener):
        def __init__(self):
            self.started = {}

        def on_start(self, e):
            try:
                d = e.data or {}
                self.started[id(d.get("dispatcher")), str(d.get("args"))] = time.time()
            except Exception:  # noqa: BLE001 - never disturb the program being measured
                pass

        def on_end(self, e):
            try:
                d = e.data or {}
                t0 = self.started.pop((id(d.get("dispatcher")), str(d.get("args"))), 0.0)
                fn = getattr(d.get("dispatcher"), "py_func", None)
                name = f"{getattr(fn, '__module__', '') or ''}.{getattr(fn, '__qualname__', '?')}"
                with open(os.environ["COMPLOG"], "a") as f:
                    f.write(f"{os.getpid()}\t{t0:.3f}\t{time.time():.3f}\t{name}\t{d.get('args')}\n")
            except Exception:  # noqa: BLE001
                pass

    if os.environ.get("COMPLOG"):
        _event.register("numba:compile", _Log())
except Exception:  # noqa: BLE001 - no numba: nothing to log
    pass
