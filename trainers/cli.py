"""The ``jaxlm`` command line (arguments parsed and type-checked by `tyro`).

    jaxlm quickstart [--steps N] [--rl-steps N] [--out DIR]
    jaxlm train CONFIG [key=value ...] [--multihost]   # CONFIG: configs/<name>.py or a .py path
    jaxlm eval --model DIR [source:countdown] [--n 200]
    jaxlm generate --prompt "12+30=" [--model DIR] [--max-new-tokens 32] [--temperature 0]
    jaxlm convert SRC DST [--to orbax|hf]
    jaxlm quantize MODEL --out DIR [--method rtn|hadamard|wush|quarot|twinquant|qat] [--format mxfp4|nvfp4|int4]
                   [--inner rtn|gptq]
    jaxlm compress MODEL --out DIR [--method a3] [--budget 0.5] [--components qk,ov,mlp] [--calib N]
        [--allocation uniform|global]
    jaxlm edit MODEL --requests FILE [--method crispedit|finetune|alphaedit|memit|all] [--batches K]

``--model`` takes a HuggingFace directory or a jaxlm (orbax) checkpoint; without it
the embedded default is used: a tiny random `ModelConfig.tiny()` model with the
byte-level tokenizer (untrained: its text is noise, its plumbing is real).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import tyro

from jaxlm.data.facts import FactWorld
from jaxlm.data.tasks import Arithmetic, Countdown, Sorting
from jaxlm.editing.crispedit import GradientEditConfig
from jaxlm.editing.locate import LocateEditConfig


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """Sample completions for one or more prompts."""

    prompt: tuple[str, ...] = ("Hello",)
    """Prompt text(s); several prompts are decoded as one batch."""
    model: Path | None = None
    """HF directory or jaxlm checkpoint; default: the embedded tiny random model."""
    max_new_tokens: int = 32
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Compute dtype for HF directories (default: the checkpoint's)."""


@dataclasses.dataclass(frozen=True)
class ConvertArgs:
    """Convert between a HuggingFace directory and a jaxlm (orbax) checkpoint."""

    src: Annotated[Path, tyro.conf.Positional]
    dst: Annotated[Path, tyro.conf.Positional]
    to: Literal["orbax", "hf"] = "orbax"
    overwrite: bool = False


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """Train an experiment config; re-running the same command resumes it."""

    config: Annotated[str, tyro.conf.Positional]
    """A config name in configs/ (e.g. quickstart) or a path to a .py file with get_config()."""
    overrides: Annotated[tuple[str, ...], tyro.conf.Positional] = ()
    """key=value overrides, e.g. trainer.steps=200 model.n_layers=4."""
    multihost: bool = False
    """Multi-host run: calls jax.distributed.initialize() first (same as trainer.multihost=true)."""


@dataclasses.dataclass(frozen=True)
class EvalArgs:
    """Task accuracy of a model by greedy decoding on held-out synthetic problems."""

    model: Path
    source: Arithmetic | Countdown | Sorting = Arithmetic()
    n: int = 200
    max_new_tokens: int = 16
    batch_size: int = 64


@dataclasses.dataclass(frozen=True)
class QuickstartArgs:
    """Train, evaluate and summarise a tiny model on 2-digit addition (CPU, minutes)."""

    steps: int | None = None
    """SFT steps (default: the config's 1000)."""
    rl_steps: int | None = None
    """GRPO iterations after SFT (default: configs/grpo_arithmetic.py's 30; 0 skips the stage)."""
    out: Path = Path("runs/quickstart")
    overrides: tuple[str, ...] = ()
    """Extra key=value overrides of the SFT config."""
    rl_overrides: tuple[str, ...] = ()
    """Extra key=value overrides of the GRPO config."""
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class EditArgs:
    """Edit facts into a model and report efficacy, generalisation, locality and capability."""

    model: Annotated[Path, tyro.conf.Positional]
    """jaxlm checkpoint (or HF directory) with a tokenizer."""
    requests: Path
    """jsonl of edit requests: prompt, target_new [, subject, target_true, paraphrase_prompts,
    neighborhood] (see jaxlm.data.facts.FactWorld.edit_requests)."""
    method: Literal["crispedit", "finetune", "alphaedit", "memit", "all"] = "crispedit"
    batches: int = 1
    """Apply the requests as this many sequential batches."""
    corpus: FactWorld | Arithmetic | Countdown | Sorting = FactWorld()
    """The corpus whose curvature / key covariance the edit protects (the model's training data)."""
    corpus_size: int = 512
    capability: Arithmetic | Countdown | Sorting = Arithmetic()
    """Capability task: exact match on its held-out split measures retention."""
    capability_n: int = 200
    gradient: GradientEditConfig = GradientEditConfig()
    locate: LocateEditConfig = LocateEditConfig()
    out: Path | None = None
    """Save the edited model here (one method only)."""
    report: Path | None = None
    """Write the metrics as JSON here."""


@dataclasses.dataclass(frozen=True)
class QuantizeArgs:
    """Quantize a model's attention/MLP projections (W4A4, or W4A16 with --weights-only) and
    save it; reports held-out accuracy before and after on the calibration task."""

    model: Annotated[Path, tyro.conf.Positional]
    out: Path
    method: Literal["rtn", "hadamard", "wush", "quarot", "twinquant", "qat"] = "wush"
    """Post-training methods, or qat: store the trained weights of a model trained with
    model.qat_format (required for such a model; --format must be that format)."""
    format: str = "mxfp4"
    """mxfp4 | nvfp4 | int4, with options after a colon, e.g. int4:group=32,scale=rms (WUSH's
    RMS-scaled midrise INT4) or mxfp4:rule=alpha3."""
    inner: Literal["rtn", "gptq"] = "rtn"
    """rtn / hadamard / wush: rounding of the transformed weights, rtn (each block on its own)
    or gptq (WUSH's GPTQ mode: error feedback through the calibration Hessian's Cholesky factor)."""
    weights_only: bool = False
    """Quantize weights only (activations stay in the model's dtype)."""
    rank: float | None = None
    """twinquant: rank of the high-precision part, an integer (e.g. 16) or a fraction of each
    projection's input width (e.g. 0.125); default 16."""
    task: Arithmetic | Countdown | Sorting | FactWorld = Arithmetic()
    """Calibration texts come from its train split; accuracy from its held-out split."""
    calibration_n: int = 256
    eval_n: int = 200
    overwrite: bool = False


@dataclasses.dataclass(frozen=True)
class CompressArgs:
    """Shrink a model's attention heads and MLP in place with A^3 (analytical low-rank, arXiv
    2505.12942) and save it; reports sizes and held-out accuracy before and after."""

    model: Annotated[Path, tyro.conf.Positional]
    out: Path
    method: Literal["a3"] = "a3"
    budget: float = 0.5
    """Kept fraction of each compressed component's parameters, in (0, 1]."""
    components: str = "qk,ov,mlp"
    """Comma-separated subset of qk (query/key head width), ov (value/output head width), mlp."""
    qk_head_dim: int | None = None
    """Explicit query/key width per head (overrides --budget for qk)."""
    v_head_dim: int | None = None
    """Explicit value width per head (overrides --budget for ov)."""
    ffn_dim: int | None = None
    """Explicit MLP width (overrides --budget for mlp)."""
    allocation: Literal["uniform", "global"] = "uniform"
    """uniform: every layer the same width; global: the same total width per component split over
    layers by A^3's closed-form error curves (mixed ranks; the saved model has unrolled layers)."""
    qk_rope_refit: bool = True
    """RoPE models: refit the kept frequency pairs' query columns by least squares on the scores
    (a second calibration pass); --no-qk-rope-refit keeps the selected columns unchanged."""
    qk_refit_rank: int | None = None
    """Refit along this many leading input directions only (default: all; large models need it)."""
    task: Arithmetic | Countdown | Sorting | FactWorld = Arithmetic()
    """Calibration texts come from its train split; accuracy from its held-out split."""
    calib: int = 256
    """Number of calibration texts."""
    eval_n: int = 200
    overwrite: bool = False


def run_compress(args: CompressArgs) -> dict:
    import jaxlm
    from jaxlm.checkpoint import load_model
    from jaxlm.compress import A3Config, compress_with, kv_cache_bytes
    from trainers.evaluate import task_accuracy

    a3 = A3Config(components=args.components, budget=args.budget, qk_head_dim=args.qk_head_dim,
                  v_head_dim=args.v_head_dim, ffn_dim=args.ffn_dim, allocation=args.allocation,
                  qk_rope_refit=args.qk_rope_refit, qk_refit_rank=args.qk_refit_rank)
    if args.out.exists() and not args.overwrite:
        raise SystemExit(f"{args.out} exists; pass --overwrite to replace it")
    model = load_model(args.model)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; cannot encode calibration texts")
    texts = [e["prompt"] + e["completion"] for e in (args.task.example(i, "train") for i in range(args.calib))]
    small = compress_with(model, args.method, texts, a3)
    held = [args.task.example(i, "eval") for i in range(args.eval_n)]
    before = task_accuracy(model, held, args.task.verify, tokenizer=model.tokenizer, max_new_tokens=8).accuracy
    after = task_accuracy(small, held, args.task.verify, tokenizer=model.tokenizer, max_new_tokens=8).accuracy
    jaxlm.save_checkpoint(small, args.out, overwrite=args.overwrite)
    c0, c1 = model.config, small.config
    kv = kv_cache_bytes(c1, 1, 1) / kv_cache_bytes(c0, 1, 1)
    w = lambda c, n: getattr(c, f"layer_{n}s") or getattr(c, n)  # noqa: E731 (per-layer widths when mixed)
    print(f"{args.method} ({','.join(a3.components)}, budget {args.budget}, {args.allocation}): qk_head_dim "
          f"{c0.qk_head_dim}->{w(c1, 'qk_head_dim')}, v_head_dim {c0.v_head_dim}->{w(c1, 'v_head_dim')}, "
          f"ffn_dim {c0.ffn_dim}->{w(c1, 'ffn_dim')}; "
          f"parameters {c0.num_params():,} -> {c1.num_params():,}; KV cache x{kv:.3f}")
    print(f"held-out accuracy {before:.1%} -> {after:.1%} ({args.eval_n} problems) -> {args.out}")
    return {"before": before, "after": after, "kv_cache_ratio": kv}


def run_quantize(args: QuantizeArgs) -> dict:
    import jaxlm
    from jaxlm.checkpoint import load_model
    from jaxlm.quant.apply import quantize_with
    from trainers.evaluate import task_accuracy

    from jaxlm.quant.formats import get_format

    get_format(args.format)  # a bad --format fails before the model is loaded
    if args.inner != "rtn" and args.method not in ("rtn", "hadamard", "wush"):
        raise SystemExit(f"--inner {args.inner} applies to --method rtn|hadamard|wush (got --method {args.method})")
    model = load_model(args.model)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; cannot encode calibration texts")
    if args.out.exists() and not args.overwrite:
        raise SystemExit(f"{args.out} exists; pass --overwrite to replace it")
    texts = [e["prompt"] + e["completion"] for e in (args.task.example(i, "train") for i in range(args.calibration_n))]
    rank = args.rank
    if rank is not None and rank >= 1:
        if rank != int(rank):
            raise SystemExit(f"--rank {rank} is invalid: an integer >= 1 or a fraction in (0, 1)")
        rank = int(rank)
    if rank is not None and args.method != "twinquant":
        raise SystemExit(f"--rank applies to --method twinquant only (got --method {args.method})")
    quantized = quantize_with(model, args.method, args.format, texts, weights_only=args.weights_only, rank=rank,
                              inner=args.inner)
    held = [args.task.example(i, "eval") for i in range(args.eval_n)]
    before = task_accuracy(model, held, args.task.verify, tokenizer=model.tokenizer, max_new_tokens=8).accuracy
    after = task_accuracy(quantized, held, args.task.verify, tokenizer=model.tokenizer, max_new_tokens=8).accuracy
    jaxlm.save_checkpoint(quantized, args.out, overwrite=args.overwrite)
    mode = "W4A16" if args.weights_only else "W4A4"
    inner = f" (inner {args.inner})" if args.inner != "rtn" else ""
    print(f"{args.method}{inner} {args.format} {mode}: held-out accuracy {before:.1%} -> {after:.1%} "
          f"({args.eval_n} problems) -> {args.out}")
    return {"before": before, "after": after}


def run_edit(args: EditArgs) -> dict:
    import json

    from jaxlm.checkpoint import load_model
    from jaxlm.data.facts import read_requests
    from jaxlm.editing.benchmark import METHODS, corpus_texts, markdown_table, run_method
    from jaxlm.editing.metrics import EditEvaluator

    requests = read_requests(args.requests)
    model = load_model(args.model)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; cannot encode edit requests")
    if args.out is not None and args.method == "all":
        raise SystemExit("--out saves one edited model: pick one --method")
    capability = [args.capability.example(i, "eval") for i in range(args.capability_n)]
    evaluator = EditEvaluator(model, requests, model.tokenizer, capability)
    corpus = corpus_texts(args.corpus, args.corpus_size)
    unedited = evaluator(model)
    runs = []
    for method in METHODS if args.method == "all" else (args.method,):
        runs.append(run_method(
            model, requests, method, tokenizer=model.tokenizer, corpus=corpus, evaluator=evaluator,
            batches=args.batches, gradient=args.gradient, locate=args.locate,
        ))
    print(f"{len(requests)} edits in {args.batches} batch(es) on {args.model}")
    print(markdown_table(runs, unedited))
    report = {"unedited": unedited, **{r.method: {**r.metrics, "seconds": r.seconds, "per_batch": r.per_batch,
                                                  **r.info} for r in runs}}
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2))
    if args.out is not None:
        import jaxlm

        jaxlm.save_checkpoint(runs[0].model, args.out)
        print(f"edited model -> {args.out}")
    return report


def _embedded_default():
    import jaxlm

    return jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5), tokenizer=jaxlm.ByteTokenizer())


def run_generate(args: GenerateArgs) -> list[str]:
    import jaxlm
    from jaxlm.checkpoint import load_model

    if args.model is None:
        model = _embedded_default()
        print("model: embedded default (ModelConfig.tiny, random weights, byte tokenizer)", file=sys.stderr)
    else:
        kwargs = {"dtype": args.dtype} if args.dtype else {}
        model = load_model(args.model, **kwargs)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer (tokenizer.json); cannot encode text prompts")
    start = time.perf_counter()
    result = jaxlm.generate(
        model, list(args.prompt), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, rng=args.seed,
    )
    elapsed = time.perf_counter() - start
    for prompt, text in zip(args.prompt, result.texts):
        print(f"{prompt!r} -> {text!r}")
    n = int(result.lengths.sum())
    print(f"{n} tokens in {elapsed:.2f}s (including compilation)", file=sys.stderr)
    return result.texts


def run_convert(args: ConvertArgs) -> Path:
    import jaxlm
    from jaxlm.checkpoint import load_model, save_checkpoint

    model = load_model(args.src)
    if args.to == "orbax":
        out = save_checkpoint(model, args.dst, overwrite=args.overwrite)
    else:
        if args.dst.exists() and any(args.dst.iterdir()) and not args.overwrite:
            raise SystemExit(f"{args.dst} is not empty; pass --overwrite to write into it")
        out = jaxlm.save_hf(model, args.dst)
    print(f"wrote {args.to} checkpoint to {out}")
    return out


def run_eval(args: EvalArgs) -> float:
    from jaxlm.checkpoint import load_model
    from trainers.evaluate import task_accuracy

    model = load_model(args.model)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; cannot encode prompts")
    examples = [args.source.example(i, "eval") for i in range(args.n)]
    result = task_accuracy(
        model, examples, args.source.verify, tokenizer=model.tokenizer,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
    )
    name = type(args.source).__name__.lower()
    print(f"{name}: exact-match accuracy {result.accuracy:.1%} on {result.n} held-out problems "
          f"(chance {args.source.chance_accuracy():.2%})")
    for s in result.samples[:5]:
        print(f"  {s['prompt']!r} -> {s['completion']!r} (reference {s['reference']!r})")
    return result.accuracy


def _quiet_logs() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("trainers", "jaxlm"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> None:
    cmd = tyro.cli(
        Annotated[QuickstartArgs, tyro.conf.subcommand("quickstart")]
        | Annotated[TrainArgs, tyro.conf.subcommand("train")]
        | Annotated[EvalArgs, tyro.conf.subcommand("eval")]
        | Annotated[GenerateArgs, tyro.conf.subcommand("generate")]
        | Annotated[ConvertArgs, tyro.conf.subcommand("convert")]
        | Annotated[QuantizeArgs, tyro.conf.subcommand("quantize")]
        | Annotated[CompressArgs, tyro.conf.subcommand("compress")]
        | Annotated[EditArgs, tyro.conf.subcommand("edit")],
        args=argv,
        prog="jaxlm",
    )
    _quiet_logs()
    from jaxlm.models.hf.io import CheckpointError

    try:
        if isinstance(cmd, QuickstartArgs):
            from trainers.quickstart import run_quickstart

            if cmd.rl_steps is not None and cmd.rl_steps < 0:
                raise SystemExit(f"jaxlm quickstart: --rl-steps={cmd.rl_steps} must be >= 0 (0 skips GRPO)")
            run_quickstart(steps=cmd.steps, out_dir=cmd.out, overrides=cmd.overrides, progress=cmd.progress,
                           rl_steps=cmd.rl_steps, rl_overrides=cmd.rl_overrides)
        elif isinstance(cmd, TrainArgs):
            from trainers.config import load_config
            from trainers.loop import train

            overrides = list(cmd.overrides) + (["trainer.multihost=true"] if cmd.multihost else [])
            result = train(load_config(cmd.config, overrides))
            print(f"finished at step {result.step}: {result.final_eval} -> {result.out_dir}")
        elif isinstance(cmd, EvalArgs):
            run_eval(cmd)
        elif isinstance(cmd, GenerateArgs):
            run_generate(cmd)
        elif isinstance(cmd, EditArgs):
            run_edit(cmd)
        elif isinstance(cmd, QuantizeArgs):
            run_quantize(cmd)
        elif isinstance(cmd, CompressArgs):
            run_compress(cmd)
        else:
            run_convert(cmd)
    except (CheckpointError, ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
