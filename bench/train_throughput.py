"""SFT training throughput: the jaxlm step vs a PyTorch + HF `transformers` training loop.

Same random Llama (built in transformers, loaded with `jaxlm.load_hf`), same batch of
token ids (every target trained), AdamW with global-norm clipping, fp32, CPU. jaxlm's
first step (compile) and PyTorch's first step are excluded; timed steps alternate between
the two (machine drift hits both) and the medians are compared.

    python bench/train_throughput.py      # batch 16 x 128 tokens, 4 layers, width 256
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    import jaxlm
    from trainers.config import OptimizerConfig
    from trainers.optim import make_optimizer
    from trainers.step import init_state, make_train_step

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
    )
    hf_model = transformers.LlamaForCausalLM(hf_config)
    hf_model.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        model = jaxlm.load_hf(d, dtype="float32")
    hf_model.train()

    rng = np.random.RandomState(0)
    tokens = rng.randint(0, args.vocab, (args.batch, args.seq_len)).astype(np.int32)
    B, T = tokens.shape
    batch = {
        "tokens": jnp.asarray(tokens), "loss_mask": jnp.ones((B, T), bool),
        "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1)),
    }
    opt = OptimizerConfig(lr=1e-4, warmup_steps=0, schedule="constant", weight_decay=0.0, clip_norm=1.0)

    # --- jaxlm
    graphdef, state = nnx.split(model)
    tx, schedule = make_optimizer(opt, args.steps)
    step = make_train_step(graphdef, tx, schedule)
    train_state = init_state(nnx.to_pure_dict(state), tx, 0)
    t0 = time.perf_counter()
    train_state, m = step(train_state, batch)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0

    # --- PyTorch + transformers
    torch_opt = torch.optim.AdamW(hf_model.parameters(), lr=1e-4, betas=(opt.b1, opt.b2), eps=opt.eps, weight_decay=0.0)
    ids = torch.tensor(tokens, dtype=torch.long)

    def torch_step():
        loss = hf_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
        return float(loss)

    torch_step()
    jax_times, torch_times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_state, m = step(train_state, batch)
        jax.block_until_ready(m["loss"])
        jax_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch_step()
        torch_times.append(time.perf_counter() - t0)

    n_tokens = B * T
    jax_tps = n_tokens / float(np.median(jax_times))
    torch_tps = n_tokens / float(np.median(torch_times))
    result = {
        "setting": vars(args),
        "jaxlm_tokens_per_s": round(jax_tps, 1),
        "torch_hf_tokens_per_s": round(torch_tps, 1),
        "ratio_jaxlm_over_torch": round(jax_tps / torch_tps, 2),
        "jaxlm_first_step_s_incl_compile": round(compile_s, 2),
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }
    print(json.dumps(result, indent=2))
    print(f"jaxlm {jax_tps:,.0f} tok/s | PyTorch+transformers {torch_tps:,.0f} tok/s | ratio {jax_tps / torch_tps:.2f}x")


if __name__ == "__main__":
    main()
