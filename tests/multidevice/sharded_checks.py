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
from jaxlm.sharding import VOCAB_SPLIT_RULES, batch_sharding, make_mesh, shard_model  # noqa: E402


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
            split = jaxlm.load_hf(os.path.join(d, "hf"), dtype="float32", scan_layers=scan, mesh=mesh,
                                  rules=VOCAB_SPLIT_RULES)
            spec = split.embed.get_value().sharding.spec
            check(f"[scan={scan}] load_hf(rules=VOCAB_SPLIT_RULES) splits the vocabulary {spec}",
                  spec == P(("tensor", "fsdp"), None))
            check(f"[scan={scan}] vocabulary-split forward == single device", close(split(tokens, mask=mask).logits, ref, mask))
    quantized_checks(mesh, tokens, mask)
    train_checks(mesh)
    omni_checks()
    rl_checks()
    print("ALL PASS")


def quantized_checks(mesh, tokens, mask):
    """A quantized model on a mesh: `shard_model` failed on its structured weights (no .shape)
    and `load_checkpoint(mesh=)` left them on device 0 beside mesh-placed parameters, so every
    forward failed. Their arrays are replicated over the mesh."""
    from jaxlm.quant.apply import quantize_with
    from jaxlm.quant.recipe import QuantRecipe, quantize_model

    cfg = jaxlm.ModelConfig.tiny(vocab_size=256, init_std=0.2, d_model=64, ffn_dim=128, n_heads=2, n_kv_heads=2)
    for method in ("recipe", "rtn", "quarot"):  # QArray weights (a .shape of their own) and transformed ones
        base = jaxlm.build_model(cfg, seed=0)
        q = (quantize_model(base, QuantRecipe("nvfp4")) if method == "recipe"
             else quantize_with(base, method, "mxfp4", weights_only=True))
        ref = np.asarray(q(tokens, mask=mask).logits)
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(q, os.path.join(d, "q"))
            restored = load_checkpoint(os.path.join(d, "q"), mesh=mesh)
            leaves = jax.tree.leaves(restored.layers[0].attn.q_proj.kernel.get_value())
            check(f"[{method}] restored quantized weights span the mesh",
                  all(len(x.sharding.device_set) == 8 for x in leaves))
            check(f"[{method}] restored quantized model on the mesh == in memory",
                  close(restored(tokens, mask=mask).logits, ref, mask))
        shard_model(q, mesh)
        check(f"[{method}] shard_model of a quantized model == unsharded", close(q(tokens, mask=mask).logits, ref, mask))


def train_checks(mesh):
    """A sharded SFT step equals the single-device step; the loop trains on the mesh."""
    import optax

    from jaxlm.data.pipeline import DataConfig, train_dataset
    from jaxlm.data.tasks import Arithmetic
    from jaxlm.sharding import model_shardings
    from trainers.config import ExperimentConfig, MeshConfig, OptimizerConfig, TrainerConfig
    from trainers.loop import train
    from trainers.step import init_state, make_train_step

    cfg = jaxlm.ModelConfig.tiny(vocab_size=260, d_model=64, n_heads=4, n_kv_heads=2, init_std=0.1)
    model = jaxlm.build_model(cfg, seed=1)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    data = DataConfig(source=Arithmetic(), seq_len=32, batch_size=16, pack=True)
    batch = {k: jnp.asarray(v) for k, v in next(iter(train_dataset(data, jaxlm.ByteTokenizer()))).items()}
    # an "optimizer" that keeps the gradient in its state, so gradients are compared directly
    capture = optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g)
    )
    step = make_train_step(graphdef, capture, lambda s: 1.0, grad_accum=2, donate=False)
    ref_state, ref_metrics = step(init_state(params, capture, 0), batch)

    shardings = nnx.to_pure_dict(model_shardings(model, mesh))
    sharded_params = jax.device_put(params, shardings)
    sharded_batch = jax.device_put(batch, batch_sharding(mesh))
    new_state, metrics = step(init_state(sharded_params, capture, 0), sharded_batch)
    q = new_state.opt_state["layers"][0]["attn"]["q_proj"]["kernel"]
    check(f"sharded train step: gradients stay sharded {q.sharding.spec}", q.sharding.spec == P("fsdp", "tensor"))
    loss_err = abs(float(metrics["loss"]) - float(ref_metrics["loss"]))
    check(f"sharded train step: loss equal ({loss_err:.1e})", loss_err <= 1e-6 * abs(float(ref_metrics["loss"])))
    worst = 0.0
    for g1, g2 in zip(jax.tree.leaves(ref_state.opt_state), jax.tree.leaves(new_state.opt_state)):
        g1, g2 = np.asarray(g1), np.asarray(g2)
        worst = max(worst, float(np.abs(g1 - g2).max() / (np.abs(g1).max() + 1e-12)))
    check(f"sharded train step: gradients equal (max error / max |grad| = {worst:.1e})", worst < 1e-5)

    with tempfile.TemporaryDirectory() as d:
        exp = ExperimentConfig(
            model=cfg, data=data, optimizer=OptimizerConfig(lr=1e-3, warmup_steps=1),
            trainer=TrainerConfig(steps=4, save_every=2, out_dir=d, progress=False, eval_generate=8,
                                  eval_max_new_tokens=4, mesh=MeshConfig(data=2, fsdp=2, tensor=2)),
        )
        result = train(exp)
        check(f"train() on a (2, 2, 2) mesh finishes (held-out loss {result.final_eval['loss']:.3f})",
              result.step == 4 and np.isfinite(result.final_eval["loss"]))


def omni_checks():
    """Omni training (media batches, encoders in the state) runs on a (2, 2, 2) mesh and writes an
    omni checkpoint whose encoders are the trained ones."""
    from jaxlm.data.audiovisual import AVTaskConfig
    from jaxlm.data.pipeline import DataConfig
    from jaxlm.models.omni import load_omni
    from trainers.config import ExperimentConfig, MeshConfig, OmniTrainConfig, OptimizerConfig, TrainerConfig
    from trainers.loop import train

    task = AVTaskConfig(frames=2, grid=2, patch=2, audio_frames=4, window=8, tone_frames=1)
    with tempfile.TemporaryDirectory() as d:
        exp = ExperimentConfig(
            model=jaxlm.ModelConfig.tiny(vocab_size=261, rope="mrope", d_model=32, n_layers=1, n_heads=2,
                                         n_kv_heads=2, ffn_dim=64, max_seq_len=64),
            data=DataConfig(batch_size=8), optimizer=OptimizerConfig(lr=1e-3, warmup_steps=1),
            trainer=TrainerConfig(steps=2, save_every=1, out_dir=d, progress=False, eval_generate=2,
                                  mesh=MeshConfig(data=2, fsdp=2, tensor=2)),
            algorithm=OmniTrainConfig(task=task, encoder_hidden=16, eval_examples=8),
        )
        result = train(exp)
        check(f"omni train() on a (2, 2, 2) mesh finishes (held-out loss {result.final_eval['loss']:.3f})",
              result.step == 2 and np.isfinite(result.final_eval["loss"]))
        model = load_omni(os.path.join(d, "model"))
        check("omni checkpoint from the mesh run loads", model.config.audio_token_id == 260)


def rl_checks():
    """GRPO on a (2, 2, 2) mesh: the state is placed by logical axes, and the same experience
    gives the same old log-probs and the same update as on one device (Adam eps = 1, lr = 1:
    steps proportional to the gradient, so float32 summation order cannot flip a near-zero
    entry into a +-lr step); a whole iteration runs; indivisible rows are refused."""
    import dataclasses

    from jaxlm.data.pipeline import DataConfig
    from jaxlm.data.tasks import Arithmetic
    from trainers.config import ConfigError, ExperimentConfig, GRPOConfig, MeshConfig, OptimizerConfig, TrainerConfig
    from trainers.rl.loop import GRPOTrainer

    cfg = ExperimentConfig(
        model=jaxlm.ModelConfig.tiny(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                                     vocab_size=260),
        data=DataConfig(source=Arithmetic(digits=1), seq_len=16, batch_size=4),
        optimizer=OptimizerConfig(lr=1.0, warmup_steps=0, schedule="constant", eps=1.0, weight_decay=0.0),
        trainer=TrainerConfig(steps=2, progress=False, mesh=MeshConfig(data=2, fsdp=2, tensor=2)),
        algorithm=GRPOConfig(num_generations=4, max_new_tokens=5, mu=1, minibatches=2),
    )
    model = jaxlm.build_model(cfg.model, seed=0)
    tok = jaxlm.ByteTokenizer()
    one = GRPOTrainer(cfg, model, tok, mesh=make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    sharded = GRPOTrainer(cfg, model, tok)
    s1, s8 = one.init_state(), sharded.init_state()
    q = s8.params["layers"][0]["attn"]["q_proj"]["kernel"]
    check(f"GRPO state on the mesh: q_proj {q.sharding.spec}", q.sharding.spec == P("fsdp", "tensor"))
    moments = [x.sharding.spec for path, x in jax.tree_util.tree_flatten_with_path(s8.opt_state)[0]
               if "q_proj" in jax.tree_util.keystr(path) and x.ndim == 2 and "layers'][0]" in jax.tree_util.keystr(path)]
    check(f"GRPO Adam moments placed like the parameters: q_proj {moments}",
          len(moments) == 2 and all(m == P("fsdp", "tensor") for m in moments))
    exp = one.collector(s1.params, 0, jax.random.key(0))
    exp8 = sharded.collector(s8.params, 0, jax.random.key(0))  # its 4 prompts split over data x fsdp
    same = all(np.array_equal(exp.rows[k], exp8.rows[k]) for k in ("tokens", "loss_mask", "lengths"))
    lp = float(np.abs(exp.rows["sampler_logp"] - exp8.rows["sampler_logp"]).max())
    check(f"GRPO rollouts with the prompts split over the mesh == one device (same tokens: {same}, "
          f"log-probs {lp:.1e})", same and lp < 1e-5)
    from trainers.rl.rollout import left_pad, sample_block

    block, mask = left_pad([[1, 2, 3], [4, 5], [6], [7, 8, 9]], 4, 0)
    final = sample_block(sharded.graphdef, s8.params, block, mask, jax.random.key(1), max_new_tokens=3,
                         temperature=1.0, top_p=None, pad_id=0, stop_tokens=(),
                         prompt_sharding=sharded.collector.prompt_sharding, samples_per_prompt=2)
    check(f"GRPO sampler: the decoded rows stay split over the mesh (tokens {final.tokens.sharding.spec})",
          len(final.tokens.sharding.device_set) == 8 and not final.tokens.sharding.is_fully_replicated)
    from trainers.rl.multiturn import sample_turn

    turn = dict(width=6, max_new_tokens=3, temperature=1.0, top_p=None, rng=jax.random.key(2), pad_id=0,
                stop_tokens=())
    streams = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]
    alone = sample_turn(one.graphdef, s1.params, streams, **turn)
    split = sample_turn(sharded.graphdef, s8.params, streams, prompt_sharding=sharded.collector.prompt_sharding, **turn)
    check("multi-turn sampler with the streams split over the mesh == one device", alone[0] == split[0]
          and max(abs(a - b) for la, lb in zip(alone[1], split[1]) for a, b in zip(la, lb)) < 1e-5)
    exp = dataclasses.replace(exp, rewards=np.arange(16, dtype=np.float32).reshape(4, 4) % 3)  # nonzero advantages
    r1, _ = one.prepare(s1, exp)
    r8, _ = sharded.prepare(s8, exp)
    err = float(np.abs(r1["old_logp"] - r8["old_logp"]).max())
    check(f"GRPO sharded old log-probs == one device ({err:.1e})", err < 1e-5)
    r1["old_logp"] = r8["old_logp"] = r1["old_logp"] - 0.05 * (np.arange(16)[:, None] % 3)  # ratios != 1
    n1, m1 = one.update(s1, r1, 0)
    n8, m8 = sharded.update(s8, r8, 0)
    worst, moved = 0.0, 0.0
    for a, b, p0 in zip(jax.tree.leaves(jax.device_get(n1.params)), jax.tree.leaves(jax.device_get(n8.params)),
                        jax.tree.leaves(jax.device_get(one.params))):
        worst, moved = max(worst, float(np.abs(a - b).max())), max(moved, float(np.abs(a - p0).max()))
    check(f"GRPO update moves the parameters (max step {moved:.1e})", moved > 1e-3)
    check(f"GRPO sharded update == one device (max param difference {worst:.1e})", worst < 1e-5 * moved)
    check(f"GRPO sharded loss == one device ({m1['loss']:.6f} vs {m8['loss']:.6f})",
          abs(m1["loss"] - m8["loss"]) <= 1e-5 * abs(m1["loss"]) and m1["loss"] != 0)
    state, metrics, _ = sharded.iteration(n8, 1)
    check(f"GRPO iteration on the mesh (loss {metrics['loss']:.4f})", np.isfinite(metrics["loss"]))
    odd = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=3),
                              algorithm=dataclasses.replace(cfg.algorithm, num_generations=2, minibatches=1))  # 6 rows
    bad = GRPOTrainer(odd, model, tok)
    try:
        bad.place_rows({"tokens": np.zeros((6, 8), np.int32)}, what="log-prob pass")
        check("GRPO refuses rows that do not divide over the mesh", False)
    except ConfigError as e:
        check(f"GRPO refuses rows that do not divide over the mesh: {str(e)[:60]}...", "data x fsdp = 4" in str(e))


if __name__ == "__main__":
    main()
