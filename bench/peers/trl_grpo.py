"""Secondary peer of bench/grpo_vs_tunix.py: one GRPO iteration in TRL's GRPOTrainer.

Standalone: runs under a separate venv with torch + trl (never imported by jaxlm).
Setup, from the repository root::

    python3 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0 trl
    /work/trl-venv/bin/python bench/peers/trl_grpo.py

Same workload and model shape as bench/peers/tunix_grpo.py (its CONFIG is copied
here): a tiny random ``Qwen3ForCausalLM`` (GQA, qk-norm, tied embeddings), 8
prompts x G=8 completions x 64 new tokens sampled with HF ``generate`` (KV cache,
temperature 1.0, top_p 1.0), a trivial reward, and one AdamW update on all 64
sequences (num_iterations = 1, beta = 0: no reference model). fp32, no gradient
checkpointing (TRL turns on bf16 and checkpointing by default; both are off here
to match the Tunix and jaxlm sides).

One iteration is timed from one optimizer step's end to the next (generation +
reward + loss/backward + AdamW + Trainer bookkeeping). The first ``--warmup``
iterations are reported separately. Prints one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tunix_grpo import CONFIG, make_prompts, reward_fn  # noqa: E402  (the shared config; that module imports no tunix at top level)

PAD, BOS, EOS = 0, 1, 2
_BYTE0 = 3  # byte b -> id b + 3, as in the Tunix peer's ByteTokenizer


def make_tokenizer(vocab_size: int):
    """A per-character tokenizer (PreTrainedTokenizerFast) built in memory: no hub."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS}
    for b in range(256):
        vocab[chr(b)] = b + _BYTE0  # latin-1 code point == byte, so ASCII text maps as in Tunix
    for i in range(_BYTE0 + 256, vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        padding_side="left", truncation_side="left",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=1, help="iterations reported separately")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations")
    args = ap.parse_args()

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_DISABLED", "true")
    t_import = time.perf_counter()
    import torch
    from datasets import Dataset
    from importlib.metadata import version
    from transformers import PrinterCallback, Qwen3Config, Qwen3ForCausalLM, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    logging.getLogger().setLevel(logging.ERROR)

    c = CONFIG
    torch.manual_seed(0)
    tokenizer = make_tokenizer(c["vocab_size"])
    model_cfg = Qwen3Config(
        vocab_size=c["vocab_size"],
        hidden_size=c["d_model"],
        intermediate_size=c["ffn_dim"],
        num_hidden_layers=c["n_layers"],
        num_attention_heads=c["n_heads"],
        num_key_value_heads=c["n_kv_heads"],
        head_dim=c["head_dim"],
        tie_word_embeddings=c["tie_embeddings"],
        rms_norm_eps=c["norm_eps"],
        rope_theta=c["rope_theta"],
        max_position_embeddings=c["max_seq_len"],
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        dtype="float32",
    )
    model = Qwen3ForCausalLM(model_cfg).to(torch.float32)

    total_iters = args.warmup + args.iters
    prompts = [
        p for s in range(total_iters) for p in make_prompts(s, c["n_prompts"], c["prompt_len"])
    ]
    ds = Dataset.from_dict({"prompt": prompts})
    n_seqs = c["n_prompts"] * c["group_size"]
    out_dir = tempfile.mkdtemp(prefix="trl_grpo_bench_")
    grpo_args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=n_seqs,  # completions per step = 8 prompts x G
        gradient_accumulation_steps=1,
        generation_batch_size=n_seqs,
        num_generations=c["group_size"],
        max_completion_length=c["max_new_tokens"],
        temperature=c["temperature"],
        top_p=c["top_p"],
        beta=c["beta"],
        num_iterations=c["num_iterations"],
        epsilon=c["epsilon"],
        learning_rate=c["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        max_steps=total_iters,
        shuffle_dataset=False,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )

    marks: list[float] = []
    cpu_marks: list[float] = []  # process CPU seconds (all threads): less load-sensitive
    gen_lens: list[float] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())

        def on_step_end(self, a, state, control, **kw):
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=grpo_args,
        train_dataset=ds,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.remove_callback(PrinterCallback)  # keeps stdout to the one JSON line
    inner_gen = trainer._generate_single_turn

    def counted_gen(*a, **kw):
        out = inner_gen(*a, **kw)
        gen_lens.append(float(sum(len(x) for x in out[0]) / len(out[0])))
        return out

    trainer._generate_single_turn = counted_gen
    setup_s = time.perf_counter() - t_import

    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    times = [b - a for a, b in zip(marks, marks[1:])]
    if len(times) != total_iters:
        sys.exit(f"expected {total_iters} iterations, ran {len(times)}")
    cpu_times = [b - a for a, b in zip(cpu_marks, cpu_marks[1:])]
    warm, timed = times[: args.warmup], times[args.warmup :]
    result = {
        "peer": "trl",
        "version": {"trl": version("trl"), "transformers": version("transformers"),
                    "torch": torch.__version__},
        "seconds_per_iteration": round(statistics.median(timed), 4),
        "mean_seconds_per_iteration": round(statistics.mean(timed), 4),
        "iteration_seconds": [round(t, 4) for t in timed],
        "cpu_seconds_per_iteration": round(statistics.median(cpu_times[args.warmup :]), 4),
        "warmup_seconds": [round(t, 4) for t in warm],
        "mean_completion_tokens": gen_lens,
        "optimizer_steps": int(trainer.state.global_step),
        "torch_threads": torch.get_num_threads(),
        "setup_seconds": round(setup_s, 3),
        "train_wall_seconds": round(wall, 3),
        "config": c,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
