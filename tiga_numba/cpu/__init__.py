"""numba ``parallel=True`` CPU kernels: blocked attention over implicit relations
(``blocks``), row-streaming attention over CSR (``csr``), entry points in ``api``."""
