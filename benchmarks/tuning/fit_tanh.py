"""Fit the CPU float32 kernels' tanh: tanh(x) ~ x P(x^2) / Q(x^2) on [0, 9], Q(0) = 1, minimising the
relative error (Loeb's iteration: linear least squares on x P - tanh(x) Q weighted by 1 / (tanh(x) Q)
of the previous step), then the float32 error of the Horner evaluation the kernels do, against
float64, on a dense grid. Prints the coefficients (cpu/score_codegen.py's _TANH_P / _TANH_Q are the
degree (4, 4) ones).

    python benchmarks/tuning/fit_tanh.py [--degrees 4,4 5,3 6,3]
"""
import argparse

import numpy as np

C = 9.0   # float32's tanh is 1 beyond


def fit(npd, nqd, iterations=40):
    x = (np.cos(np.linspace(0, np.pi, 40000)) + 1) * C / 2
    x = np.unique(np.concatenate([x[x > 1e-4], np.logspace(-4, 0, 2000)]))
    y, z = np.tanh(x), x * x
    q_prev = np.ones_like(x)
    for _ in range(iterations):
        A = np.hstack([x[:, None] * z[:, None] ** np.arange(npd + 1),
                       -y[:, None] * z[:, None] ** np.arange(1, nqd + 1)])
        w = 1.0 / (y * q_prev)
        scale = np.abs(A).max(0)   # column scaling for the conditioning
        sol = np.linalg.lstsq(A * w[:, None] / scale, y * w, rcond=None)[0] / scale
        p, q = sol[:npd + 1], np.concatenate([[1.0], sol[npd + 1:]])
        q_new = np.polyval(q[::-1], z)
        if np.any(q_new <= 0):
            break
        q_prev = q_new
    return p, q


def float32_error(p, q):
    xs = np.concatenate([np.linspace(1e-5, C + 1, 2_000_001), np.logspace(-8, 0, 20000)]).astype(np.float32)
    xc = np.minimum(xs, np.float32(C))
    zz = xc * xc
    P = np.float32(p[-1])
    for c in p[-2::-1]:
        P = (P * zz + np.float32(c)).astype(np.float32)
    Q = np.float32(q[-1])
    for c in q[-2::-1]:
        Q = (Q * zz + np.float32(c)).astype(np.float32)
    r = np.minimum((xc * P / Q).astype(np.float32), np.float32(1.0))
    ref = np.tanh(xs.astype(np.float64))
    err = np.abs(r - ref) / ref
    return float(err.max()), float(xs[err.argmax()])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degrees", nargs="+", default=["4,4"], help="numerator,denominator degrees in x^2")
    a = ap.parse_args()
    for d in a.degrees:
        npd, nqd = (int(v) for v in d.split(","))
        p, q = fit(npd, nqd)
        err, where = float32_error(p, q)
        print(f"degrees ({npd}, {nqd}): float32 max relative error {err:.2e} at x = {where:g}")
        print(f"  P = {tuple(float(c) for c in p)}")
        print(f"  Q = {tuple(float(c) for c in q)}")


if __name__ == "__main__":
    main()
