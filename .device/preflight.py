"""GPU preflight: our attention kernels on this device against a float32 reference, and their speed."""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sdxl.models import attention

print("devices", jax.devices(), "jax", jax.__version__, flush=True)


def run(kernel, q, k, v, lengths):
    os.environ["SDXL_ATTENTION"] = kernel
    fn = jax.jit(lambda q, k, v, n: attention.dot_product_attention(q, k, v, n))
    compiled = fn.lower(q, k, v, lengths).compile()
    used = attention.kernels_in(compiled)
    out = compiled(q, k, v, lengths).block_until_ready()
    start = time.perf_counter()
    for _ in range(10):
        out = compiled(q, k, v, lengths)
    out.block_until_ready()
    return np.asarray(out, np.float32), used, (time.perf_counter() - start) / 10


ok = True
rng = np.random.default_rng(0)
for batch, t, s, heads in [(8, 4096, 4096, 10), (8, 4096, 77, 10), (8, 1024, 1024, 20), (8, 1024, 77, 20)]:
    q, k, v = (jnp.asarray(rng.standard_normal((batch, n, heads, 64)), jnp.bfloat16) for n in (t, s, s))
    lengths = jnp.asarray([s, max(1, s // 3)] * (batch // 2), jnp.int32)
    reference = np.asarray(
        jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), key_value_seq_lengths=lengths,
                                     implementation="xla"))
    row = [f"[{batch},{t},{heads},64] x {s} keys"]
    for kernel in ("xla", "cudnn"):
        try:
            out, used, seconds = run(kernel, q, k, v, lengths)
            err = float(np.abs(out - reference).max())
            row.append(f"{kernel}: kernels {sorted(used)} max|err| {err:.2e} {seconds * 1e3:.3f} ms")
            if kernel == "cudnn" and (used != {"cudnn"} or err > 0.05):
                ok = False
        except Exception as e:  # noqa: BLE001
            row.append(f"{kernel}: FAILED {type(e).__name__}: {str(e)[:300]}")
            ok = kernel != "cudnn" and ok
            if kernel == "cudnn":
                ok = False
    print(" | ".join(row), flush=True)
print("cudnn ok" if ok else "cudnn NOT ok", flush=True)
sys.exit(0 if ok else 3)
