"""CuPy computations (BLAS, elementwise, reduction, a raw kernel); one JSON line of results."""

import json

import cupy

from managed import summarise

SCALE = cupy.RawKernel(r'''
extern "C" __global__ void scale(const float *x, float *y, float a, int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + 1.0f;
}''', "scale")


def main():
    rng = cupy.random.default_rng(7)
    a = rng.standard_normal((1024, 1024), dtype=cupy.float32)
    b = rng.standard_normal((1024, 1024), dtype=cupy.float32)
    c = a @ b
    d = cupy.tanh(c) * 0.5 + cupy.exp(-cupy.abs(a))
    y = cupy.empty_like(d)
    n = d.size
    SCALE(((n + 255) // 256,), (256,), (d, y, cupy.float32(3.0), cupy.int32(n)))
    total = float(y.astype(cupy.float64).sum())
    norms = [float(cupy.linalg.norm(m)) for m in (a, b, c, d, y)]
    print(json.dumps({"framework": "cupy", "checksum": total, "norms": norms,
                      "managed": summarise(m.data.ptr for m in (a, b, c, d, y))}))


if __name__ == "__main__":
    main()
