"""JAX computations (jit, grad, matmul); one JSON line of results. Preallocation must be off."""

import json
import os

assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false", "run with preallocation off"
# Autotuning times candidate kernels and may pick another one on the next run: results would
# differ in the last bits between two runs of the same program.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_autotune_level=0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from managed import summarise  # noqa: E402


def main():
    key = jax.random.PRNGKey(3)
    k1, k2 = jax.random.split(key)
    w = jax.random.normal(k1, (512, 512), dtype=jnp.float32)
    x = jax.random.normal(k2, (256, 512), dtype=jnp.float32)

    @jax.jit
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    grad = jax.jit(jax.grad(loss))
    for _ in range(20):
        w = w - 0.1 * grad(w, x)
    final = float(loss(w, x))
    arrays = [w, x, grad(w, x)]
    for array in arrays:
        array.block_until_ready()
    print(json.dumps({"framework": "jax", "checksum": float(jnp.sum(w)),
                      "loss": final, "devices": [str(d) for d in jax.devices()],
                      "managed": summarise(a.unsafe_buffer_pointer() for a in arrays)}))


if __name__ == "__main__":
    main()
