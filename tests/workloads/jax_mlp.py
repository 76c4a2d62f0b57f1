"""A deterministic JAX training loop (the GPU frameworks matrix of
docs/compatibility.md):
a two-layer MLP under ``jax.jit``, trained by SGD with momentum on batches
drawn from a fixed key folded with the step number, beside a ballast array
that never changes. Each line carries the step, the loss and a digest of the
parameters and momentum; the last one says ``final=<sha256>``. A run that was
checkpointed and restored on the way must print the same ``final`` as an
uninterrupted one (same GPU, same flags).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.12 \\
    XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0" \\
    python -m tests.workloads.jax_mlp --steps 400 --gib 1 [--interval 0.05]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

SEED = 20261126


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--width", type=int, default=2048)
    a = ap.parse_args()

    key = jax.random.PRNGKey(SEED)
    k1, k2, kb, kd = jax.random.split(key, 4)
    w = a.width
    params = {"w1": jax.random.normal(k1, (w, 4 * w)) * 0.02, "b1": jnp.zeros(4 * w),
              "w2": jax.random.normal(k2, (4 * w, w)) * 0.02, "b2": jnp.zeros(w)}
    mom = jax.tree_util.tree_map(jnp.zeros_like, params)
    ballast = jax.random.uniform(kb, (int(a.gib * 2**30) // 4,), dtype=jnp.float32)
    ballast_sum = float(jnp.sum(ballast, dtype=jnp.float32))

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    @jax.jit
    def step_fn(p: Any, m: Any, i: Any) -> Any:
        kx = jax.random.fold_in(kd, i)
        x = jax.random.normal(kx, (256, w))
        y = jnp.sin(x)
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        m = jax.tree_util.tree_map(lambda mm, gg: 0.9 * mm + gg, m, g)
        p = jax.tree_util.tree_map(lambda pp, mm: pp - 0.01 * mm, p, m)
        return p, m, loss

    def digest() -> str:
        h = hashlib.sha256()
        for tree in (params, mom):
            for leaf in jax.tree_util.tree_leaves(tree):
                h.update(np.asarray(leaf).tobytes())
        return h.hexdigest()

    for i in range(1, a.steps + 1):
        params, mom, loss = step_fn(params, mom, i)
        line = f"step={i} loss={float(loss):.8f}"
        if i % 10 == 0 or i == a.steps:
            line += f" hash={digest()[:16]}"
        print(line, flush=True)
        time.sleep(a.interval)
    ok = float(jnp.sum(ballast, dtype=jnp.float32)) == ballast_sum
    print(f"final={digest()} ballast_ok={ok} steps={a.steps} "
          f"device={jax.devices()[0].device_kind}", flush=True)


if __name__ == "__main__":
    main()
