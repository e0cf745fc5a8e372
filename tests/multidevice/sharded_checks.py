"""Multi-device checks, run in their own process with 8 forced CPU devices
(`tests/test_multidevice.py` starts it: the device count is fixed when JAX starts)."""

import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxlm  # noqa: E402
from jaxlm.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from jaxlm.models.params import flat_params, model_from_flat  # noqa: E402
from jaxlm.sharding import batch_sharding, make_mesh, shard_model  # noqa: E402


def check(name, ok):
    print(("PASS " if ok else "FAIL ") + name, flush=True)
    if not ok:
        sys.exit(1)


def close(out, ref, mask):
    """fp32 agreement up to rounding: per-device shapes change XLA's kernels and summation
    order. For this model the single-device fp32 logits are themselves 1.3e-5 from a
    float64 evaluation (max |logit| 6.8), so the bound is 1e-5 relative to the logit scale."""
    out, ref = np.asarray(out)[np.asarray(mask)], ref[np.asarray(mask)]
    err, scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
    print(f"    max abs {err:.2e}, max |logit| {scale:.2f}")
    return err <= 1e-5 * (1.0 + scale)


def main():
    assert jax.device_count() == 8, jax.devices()
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 256, (4, 16)), jnp.int32)
    mask = np.ones((4, 16), bool)
    mask[1, :5] = False
    mask = jnp.asarray(mask)

    for scan in (False, True):
        cfg = jaxlm.ModelConfig.tiny(vocab_size=256, scan_layers=scan, qkv_bias=True, init_std=0.2, family="qwen2")
        model = jaxlm.build_model(cfg, seed=0)
        ref = np.asarray(model(tokens, mask=mask).logits)
        ref_gen = jaxlm.generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6, temperature=0)

        sharded = model_from_flat(cfg, flat_params(model))
        shard_model(sharded, mesh)
        q = sharded.layers.attn.q_proj.kernel if scan else sharded.layers[0].attn.q_proj.kernel
        expected = P(None, "fsdp", "tensor") if scan else P("fsdp", "tensor")
        check(f"[scan={scan}] q_proj spec {q.get_value().sharding.spec}", q.get_value().sharding.spec == expected)
        shard_shape = q.get_value().addressable_shards[0].data.shape
        check(f"[scan={scan}] q_proj is split across devices {shard_shape}", shard_shape[-1] == cfg.q_dim // 2)
        embed = sharded.embed.get_value()
        check(f"[scan={scan}] embed spec {embed.sharding.spec}", embed.sharding.spec == P("tensor", "fsdp"))

        graphdef, params = nnx.split(sharded)
        fwd = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, mask=m).logits)
        out = fwd(params, jax.device_put(tokens, batch_sharding(mesh)), jax.device_put(mask, batch_sharding(mesh)))
        check(f"[scan={scan}] sharded forward == single device", close(out, ref, mask))

        gen = jaxlm.generate(sharded, [[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6, temperature=0)
        check(f"[scan={scan}] sharded greedy generate == single device", np.array_equal(gen.tokens, ref_gen.tokens))

        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(sharded, os.path.join(d, "ckpt"))
            restored = load_checkpoint(os.path.join(d, "ckpt"), mesh=mesh)
            rq = restored.layers.attn.q_proj.kernel if scan else restored.layers[0].attn.q_proj.kernel
            check(f"[scan={scan}] restore onto mesh keeps the spec", rq.get_value().sharding.spec == expected)
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
                flat_params(model).values(), flat_params(restored).values()))
            check(f"[scan={scan}] restored sharded params are exact", same)
            jaxlm.save_hf(sharded, os.path.join(d, "hf"))
            loaded = jaxlm.load_hf(os.path.join(d, "hf"), dtype="float32", scan_layers=scan, mesh=mesh)
            lq = loaded.layers.attn.q_proj.kernel if scan else loaded.layers[0].attn.q_proj.kernel
            check(f"[scan={scan}] load_hf(mesh=...) places shards", lq.get_value().sharding.spec == expected)
            check(f"[scan={scan}] load_hf on mesh forward == single device", close(loaded(tokens, mask=mask).logits, ref, mask))
    print("ALL PASS")


if __name__ == "__main__":
    main()
