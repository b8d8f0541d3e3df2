"""Error of the two tanh the tensor-core kernels can compile (generator/modifier.py: TANH) against
float64, on this GPU: the hardware tanh.approx.f32 and 1 - 2 / (2^(2x log2 e) + 1) on
ex2.approx.ftz / rcp.approx.ftz. Prints the largest absolute and relative errors over a dense grid
of float32 inputs in [-12, 12].

    python benchmarks/gpu/tanh_error.py
"""
import cupy
import numpy as np

SOURCE = r"""
extern "C" __global__ void tanhs(const float* x, float* hw, float* e2, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i], t, e, r;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(v));
    hw[i] = t;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * 2.8853900817779268f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.0f));
    e2[i] = fmaf(-2.0f, r, 1.0f);
}
"""


def main():
    kernel = cupy.RawKernel(SOURCE, "tanhs")
    x = cupy.linspace(-12, 12, 1 << 24, dtype=cupy.float32)
    x = cupy.concatenate([x, cupy.asarray([0.0, 1e-30, -1e-30, 1e-6, -1e-6, 88.0, -88.0], cupy.float32)])
    hw, e2 = cupy.empty_like(x), cupy.empty_like(x)
    n = x.size
    kernel(((n + 255) // 256,), (256,), (x, hw, e2, np.int64(n)))
    exact = np.tanh(cupy.asnumpy(x).astype(np.float64))
    for name, got in (("tanh.approx.f32", hw), ("ex2 + rcp", e2)):
        err = np.abs(cupy.asnumpy(got).astype(np.float64) - exact)
        rel = err / np.maximum(np.abs(exact), 1e-30)
        big = np.abs(exact) > 1e-3
        print(f"{name:16s} max abs error {err.max():.3e}   max rel error (|tanh| > 1e-3) {rel[big].max():.3e}   "
              f"at x = {float(cupy.asnumpy(x)[np.argmax(err)]):.4f}")


if __name__ == "__main__":
    main()
