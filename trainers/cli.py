"""The ``jaxlm`` command line: arguments parsed and type-checked by `tyro`, each verb a thin
call into a library function.

    jaxlm quickstart [--steps N] [--rl-steps N] [--out DIR]
    jaxlm train CONFIG [KEY=VALUE ...] [--multihost]     # CONFIG: configs/<name>.py or a .py path
    jaxlm train CONFIG --help                             # the config's keys, types, defaults
    jaxlm eval --model DIR [source:countdown] [--n 200]
    jaxlm generate --prompt "12+30=" [--model DIR] [--chat] [--max-new-tokens 32] [--temperature 0]
                   [--regex PATTERN | --json-schema FILE] [--num-beams K --num-return-sequences R]
                   [--steps S --block-length L | --threshold T] [--edit-rounds R]  # a diffusion checkpoint
    jaxlm convert SRC DST [--to orbax|hf] [--overwrite]
    jaxlm quantize MODEL --out DIR [--method wush] [--format nvfp4] [--inner gptq]
    jaxlm compress MODEL --out DIR [--budget 0.5] [--components qk,ov,mlp]
    jaxlm edit MODEL --requests FILE [--method crispedit|finetune|alphaedit|memit|all]
    jaxlm serve-stream MODEL --draft DIR --prompts FILE [spec:opt-hydra|ens-eagle|osd|static]
    jaxlm logprobs MODEL --data FILE --out FILE [--as behavior|target|teacher] [--top-k K]

``--model`` / ``MODEL`` take a HuggingFace directory or a jaxlm (orbax) checkpoint; without
``--model``, ``generate`` uses the embedded default: a tiny random `ModelConfig.tiny()` model
with the byte-level tokenizer (untrained: its text is noise, its plumbing is real).

Usage errors (a bad flag, config, override, file or checkpoint) print one ``jaxlm: error:``
line and exit with status 2; a run that fails (training that diverges) exits with 1. This
module imports JAX only after the arguments are parsed, so ``--help`` is instant.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import tyro

from jaxlm.data.facts import FactWorld
from jaxlm.data.tasks import Arithmetic, Countdown, Sorting
from jaxlm.editing.crispedit import GradientEditConfig
from jaxlm.editing.locate import LocateEditConfig
from jaxlm.inference.online_spec import OnlineSpecConfig

Task = Arithmetic | Countdown | Sorting
CalibrationTask = Arithmetic | Countdown | Sorting | FactWorld
OnlineSpecPreset = tyro.extras.subcommand_type_from_defaults(
    {name: OnlineSpecConfig.preset(name) for name in ("opt_hydra", "ens_eagle", "osd", "static")},
    descriptions={
        "opt_hydra": "Opt-Hydra: SGD momentum 0.9 kept across chunks, lr 0.1, 3 epochs, chunks of 80.",
        "ens_eagle": "Online ensemble: learners at lr 5e-4 / 1e-3 / 1e-1, weights softmax(-loss / 1.2), chunks of 40.",
        "osd": "OSD baseline: distil only where the draft's proposal was wrong, Opt-Hydra's optimizer.",
        "static": "The offline draft, never updated (the baseline).",
    },
)


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """Sample completions for one or more prompts."""

    prompt: Annotated[tuple[str, ...], tyro.conf.arg(metavar="TEXT [TEXT ...]")] = ("Hello",)
    """Prompt text(s); several prompts are decoded as one batch."""
    model: Annotated[Path | None, tyro.conf.arg(metavar="DIR")] = None
    """HF directory or jaxlm checkpoint; default: the embedded tiny random model."""
    chat: bool = False
    """Send each prompt as a user message through the model's chat template (with the
    assistant's generation prompt); the built-in format for tokenizers without a template."""
    max_new_tokens: int = 32
    """Tokens to generate per prompt."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_k: int | None = None
    """Keep only the k most likely tokens (default: all)."""
    top_p: float | None = None
    """Nucleus sampling: keep the smallest set of tokens with this much probability."""
    seed: int = 0
    """Random seed of the sampler."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Compute dtype for HF directories (default: the checkpoint's)."""
    regex: Annotated[str | None, tyro.conf.arg(metavar="PATTERN")] = None
    """Constrain every completion to match this regular expression (on-device token masks)."""
    json_schema: Annotated[Path | None, tyro.conf.arg(metavar="FILE")] = None
    """Constrain every completion to JSON valid under the schema in this file."""
    num_beams: int = 1
    """Beam search with this many beams (1: sample, or greedy at temperature 0)."""
    length_penalty: float = 1.0
    """Beam search: hypotheses are ranked by sum log p / length ** length_penalty."""
    num_return_sequences: int = 1
    """Beam search: print this many best hypotheses per prompt (at most --num-beams)."""
    steps: int | None = None
    """Masked diffusion models: denoising steps (default: one per generated token)."""
    block_length: int | None = None
    """Masked diffusion models: decode in blocks of this many tokens, left to right (default: one block)."""
    threshold: float | None = None
    """Masked diffusion models: commit every token whose confidence is above this (Fast-dLLM) instead of a
    fixed number per step."""
    edit_rounds: int | None = None
    """Masked diffusion edit models (ME-DLM: next-token head and delete token): edit rounds after mask
    diffusion (delete / replace / insert; stops early once nothing changes)."""
    edits_per_round: int | None = None
    """With --edit-rounds: apply only each response's this many most confident edits per round (default:
    every predicted edit)."""
    edit_threshold: float | None = None
    """With --edit-rounds: make only the edits whose prediction has at least this probability."""


@dataclasses.dataclass(frozen=True)
class ConvertArgs:
    """Convert between a HuggingFace directory and a jaxlm (orbax) checkpoint."""

    src: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="SRC")]
    """The model to read: a HF directory or a jaxlm checkpoint."""
    dst: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="DST")]
    """Where to write it (may be SRC itself with --overwrite)."""
    to: Literal["orbax", "hf"] = "orbax"
    """Output format: orbax (a jaxlm checkpoint) or hf (safetensors + config.json)."""
    overwrite: bool = False
    """Replace DST if it exists (written beside it, then swapped in)."""


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """Train an experiment config; re-running the same command resumes it.
    Add --help after CONFIG for the config's keys, types and defaults."""

    config: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="CONFIG")]
    """A config name in configs/ (e.g. quickstart) or a path to a .py file with get_config()."""
    overrides: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="[KEY=VALUE ...]")] = ()
    """Config overrides, e.g. trainer.steps=200 model.n_layers=4 (none by default)."""
    multihost: bool = False
    """Multi-host run: calls jax.distributed.initialize() first (same as trainer.multihost=true)."""


@dataclasses.dataclass(frozen=True)
class EvalArgs:
    """Task accuracy of a model by greedy decoding on held-out synthetic problems."""

    model: Annotated[Path, tyro.conf.arg(metavar="DIR")]
    """HF directory or jaxlm checkpoint with a tokenizer."""
    source: Task = Arithmetic()
    """The task whose held-out split is decoded."""
    n: int = 200
    """Held-out problems to decode (>= 1)."""
    max_new_tokens: int = 16
    """Tokens generated per problem."""
    batch_size: int = 64
    """Problems decoded together (>= 1)."""
    pass_at: tuple[int, ...] = ()
    """Also report pass@k for each k given, from max(k) samples per problem (empty: greedy only)."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples (> 0)."""


@dataclasses.dataclass(frozen=True)
class QuickstartArgs:
    """Train, evaluate and summarise a tiny model on 2-digit addition (CPU, minutes)."""

    steps: int | None = None
    """SFT steps (default: the config's 1000)."""
    rl_steps: int | None = None
    """GRPO iterations after SFT (default: configs/grpo_arithmetic.py's 30; 0 skips the stage)."""
    out: Annotated[Path, tyro.conf.arg(metavar="DIR")] = Path("runs/quickstart")
    """Run directory (SFT in DIR, GRPO in DIR/grpo, the W4A4 model in DIR/model_w4a4)."""
    overrides: Annotated[tuple[str, ...], tyro.conf.arg(metavar="KEY=VALUE")] = ()
    """Extra overrides of the SFT config."""
    rl_overrides: Annotated[tuple[str, ...], tyro.conf.arg(metavar="KEY=VALUE")] = ()
    """Extra overrides of the GRPO config."""
    progress: bool = True
    """Show progress bars."""


@dataclasses.dataclass(frozen=True)
class EditArgs:
    """Edit facts into a model and report efficacy, generalisation, locality and capability."""

    model: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL")]
    """A jaxlm checkpoint (or HF directory) with a tokenizer."""
    requests: Annotated[Path, tyro.conf.arg(metavar="FILE")]
    """jsonl of edit requests (prompt, target_new; optionally subject, target_true, paraphrase_prompts, neighborhood)."""
    method: Literal["crispedit", "finetune", "alphaedit", "memit", "all"] = "crispedit"
    """The editing method, or all four for a comparison table."""
    batches: int = 1
    """Apply the requests as this many sequential batches."""
    corpus: CalibrationTask = FactWorld()
    """The corpus whose curvature / key covariance the edit protects (the model's training data)."""
    corpus_size: int = 512
    """Corpus texts used for that curvature."""
    capability: Task = Arithmetic()
    """Capability task: exact match on its held-out split measures retention."""
    capability_n: int = 200
    """Held-out capability problems."""
    gradient: GradientEditConfig = GradientEditConfig()
    """Settings of the gradient methods (crispedit, finetune)."""
    locate: LocateEditConfig = LocateEditConfig()
    """Settings of the locate-then-edit methods (alphaedit, memit)."""
    out: Annotated[Path | None, tyro.conf.arg(metavar="DIR")] = None
    """Save the edited model here (one method only)."""
    report: Annotated[Path | None, tyro.conf.arg(metavar="FILE")] = None
    """Write the metrics as JSON here."""
    length_normalized: bool = True
    """ES/PS/NS compare each target's per-token NLL (CounterFact); --no-length-normalized compares summed log-probabilities."""
    overwrite: bool = False
    """Replace --out if it exists."""


@dataclasses.dataclass(frozen=True)
class QuantizeArgs:
    """Quantize a model's attention/MLP projections (W4A4, or W4A16 with --weights-only) and
    save it; reports held-out accuracy before and after on the calibration task."""

    model: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL")]
    """A jaxlm checkpoint or HF directory with a tokenizer."""
    out: Annotated[Path, tyro.conf.arg(metavar="DIR")]
    """Where to save the quantized model (may be MODEL itself with --overwrite)."""
    method: Literal["rtn", "hadamard", "wush", "quarot", "twinquant", "qat"] = "wush"
    """A post-training method, or qat: store the trained weights of a model trained with
    model.qat_format (required for such a model; --format must be that format)."""
    format: str = "mxfp4"
    """mxfp4 | nvfp4 | int4, with options after a colon, e.g. int4:group=32,scale=rms (WUSH's
    RMS-scaled midrise INT4) or mxfp4:rule=alpha3."""
    inner: Literal["rtn", "gptq"] = "rtn"
    """For rtn / hadamard / wush: round the transformed weights block by block (rtn) or with
    GPTQ error feedback through the calibration Hessian (gptq, WUSH's GPTQ mode)."""
    weights_only: bool = False
    """Quantize weights only (activations stay in the model's dtype)."""
    rank: float | None = None
    """twinquant: rank of the high-precision part, an integer (e.g. 16) or a fraction of each
    projection's input width (e.g. 0.125); default 16."""
    task: CalibrationTask = Arithmetic()
    """Calibration texts come from its train split; accuracy from its held-out split."""
    calibration_n: int = 256
    """Calibration texts."""
    eval_n: int = 200
    """Held-out problems for the accuracy before and after (0 skips the measurement)."""
    overwrite: bool = False
    """Replace --out if it exists (written beside it, then swapped in)."""


@dataclasses.dataclass(frozen=True)
class CompressArgs:
    """Shrink a model's attention heads and MLP with A^3 (analytical low-rank compression,
    arXiv 2505.12942) and save it; reports sizes and held-out accuracy before and after."""

    model: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL")]
    """A jaxlm checkpoint or HF directory with a tokenizer."""
    out: Annotated[Path, tyro.conf.arg(metavar="DIR")]
    """Where to save the compressed model (may be MODEL itself with --overwrite)."""
    method: Literal["a3"] = "a3"
    """The compression method."""
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
    task: CalibrationTask = Arithmetic()
    """Calibration texts come from its train split; accuracy from its held-out split."""
    calib: int = 256
    """Number of calibration texts."""
    eval_n: int = 200
    """Held-out problems for the accuracy before and after (0 skips the measurement)."""
    overwrite: bool = False
    """Replace --out if it exists (written beside it, then swapped in)."""


@dataclasses.dataclass(frozen=True)
class ServeStreamArgs:
    """Serve a stream of prompts with speculative decoding while the draft learns from the
    target's verification between chunks (OnlineSPEC, arXiv 2603.12617); reports tokens per
    verify round and tokens/s per chunk. Outputs are the target's own (greedy at temperature 0)."""

    model: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL")]
    """The target: a jaxlm checkpoint or HF directory with a tokenizer."""
    draft: Annotated[Path, tyro.conf.arg(metavar="DIR")]
    """The draft: a smaller jaxlm checkpoint or HF directory with the target's vocabulary."""
    prompts: Annotated[Path, tyro.conf.arg(metavar="FILE")]
    """jsonl, one {"prompt": "..."} per line, served in file order (other keys are copied to --completions)."""
    spec: OnlineSpecPreset = OnlineSpecConfig.preset("opt_hydra")
    """How the draft adapts: a preset (spec:opt-hydra, spec:ens-eagle, spec:osd, spec:static), each field overridable."""
    completions: Annotated[Path | None, tyro.conf.arg(metavar="FILE")] = None
    """Write each prompt's row with its "completion" (and "tokens") here as jsonl."""
    report: Annotated[Path | None, tyro.conf.arg(metavar="FILE")] = None
    """Write the per-chunk measurements and the config as JSON here."""
    save_draft: Annotated[Path | None, tyro.conf.arg(metavar="DIR")] = None
    """Save the adapted draft here (a jaxlm checkpoint)."""
    overwrite: bool = False
    """Replace the outputs (--completions, --report, --save-draft) if they exist."""


@dataclasses.dataclass(frozen=True)
class LogprobsArgs:
    """Add a model's per-token log-probs to a training file: the behaviour policy's for PEAR
    (--as behavior), a fixed target policy's (--as target) or a teacher's, with its top-K for
    offline distillation (--as teacher --top-k K)."""

    model: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL")]
    """The scoring model: a jaxlm checkpoint or HF directory with the training run's tokenizer."""
    data: Annotated[Path, tyro.conf.arg(metavar="FILE")]
    """The training rows (.jsonl: prompt/completion or messages)."""
    out: Annotated[Path, tyro.conf.arg(metavar="FILE")]
    """Where the rows go with the new columns (.jsonl)."""
    as_: Annotated[Literal["behavior", "target", "teacher"], tyro.conf.arg(name="as")] = "behavior"
    """Which column to write: behavior_logprobs, target_logprobs or teacher_logprobs."""
    top_k: int = 0
    """With --as teacher: also write the K most likely tokens' ids and log-probs per position."""
    batch_size: int = 16
    """Rows per forward pass."""
    overwrite: bool = False
    """Replace --out if it exists."""


@dataclasses.dataclass(frozen=True)
class JudgeArgs:
    """Judge pairs of responses with a model's verdict-token probabilities, both orders in one
    batched call; with --calibration, accept judgments by SCOPE's threshold at --alpha."""

    model: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL")]
    """The judge: a jaxlm checkpoint or HF directory."""
    pairs: Annotated[Path, tyro.conf.arg(metavar="FILE")]
    """jsonl, one {"question": ..., "a": ..., "b": ...} per line."""
    out: Annotated[Path, tyro.conf.arg(metavar="FILE")]
    """Where the judged rows go (.jsonl): p_ab, p_ba, p_a, verdict, bpe, margin (and accepted)."""
    calibration: Annotated[Path | None, tyro.conf.arg(metavar="FILE")] = None
    """Labelled pairs (each with "label": "A" or "B") for SCOPE's acceptance threshold."""
    alpha: float = 0.1
    """The error rate allowed among accepted judgments (with --calibration)."""
    one_order: bool = False
    """Ask only in the given order (no debiasing; half the compute)."""
    prompt_format: str | None = None
    """The judging prompt with {question}, {first}, {second} (default: the built-in template)."""
    batch_size: int = 32
    """Pairs per forward pass."""
    overwrite: bool = False
    """Replace --out if it exists."""


class UsageError(ValueError):
    """A command-line argument is invalid (exit status 2)."""


_OVERWRITE_HINT = "pass --overwrite to replace it"


def _load(path: Path, **kwargs):
    from jaxlm.checkpoint import load_model

    if kwargs and (Path(path) / "config").is_dir() and (Path(path) / "params").is_dir():
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in sorted(kwargs))
        raise UsageError(f"{flags} applies to HF directories; {path} is a jaxlm checkpoint, restored as its "
                         "stored config says")
    return load_model(path, **kwargs)


def _file_outputs(inside: tuple[str, Path | None] | None = None, **paths: Path | None) -> None:
    """Output files can be written: not a directory, no file where a parent directory must
    be (found only after the work, with part of the outputs written), and not inside the
    directory output ``inside`` = ``(flag, path)``, which is replaced as a whole."""
    for flag, path in paths.items():
        if path is None:
            continue
        name = f"--{flag.replace('_', '-')}"
        path = Path(path)
        if path.is_dir():
            raise UsageError(f"{name} {path} is a directory: name the file to write")
        ancestor = next((a for a in path.absolute().parents if a.exists()), None)
        if ancestor is not None and not ancestor.is_dir():
            raise UsageError(f"{name} {path}: {ancestor} is not a directory")
        if inside is not None and inside[1] is not None:
            outer = Path(inside[1]).resolve()
            if outer == path.resolve() or outer in path.resolve().parents:
                raise UsageError(f"{name} {path} lies inside --{inside[0].replace('_', '-')} {inside[1]}, which is "
                                 "replaced as a whole when it is saved: write it elsewhere")


def _distinct_outputs(**paths: Path | None) -> None:
    """The command's output flags name different files, none of them an input (two outputs
    on one path: the second overwrote the first, which was lost)."""
    seen: dict[Path, str] = {}
    for flag, path in paths.items():
        if path is None:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise UsageError(f"--{seen[key].replace('_', '-')} and --{flag.replace('_', '-')} name the same path "
                             f"{path}: give each its own")
        seen[key] = flag


def run_generate(args: GenerateArgs) -> list[str]:
    import jaxlm

    if not args.prompt:  # before the model line, so the error is the first line printed
        raise UsageError("--prompt is empty: pass at least one prompt")
    if args.model is None:
        model = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5), tokenizer=jaxlm.ByteTokenizer())
        print("model: embedded default (ModelConfig.tiny, random weights, byte tokenizer)", file=sys.stderr)
    else:
        model = _load(args.model, **({"dtype": args.dtype} if args.dtype else {}))
    if model.tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer (tokenizer.json); cannot encode text prompts")
    prompts: list = list(args.prompt)
    if args.chat:
        prompts = [model.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in prompts]
    if getattr(model.config, "mode", "causal") == "diffusion":
        return _generate_diffusion(args, model, prompts)
    diffusion_only = [f"--{n.replace('_', '-')}" for n in ("steps", "block_length", "threshold", "edit_rounds",
                                                           "edits_per_round", "edit_threshold")
                      if getattr(args, n) is not None]
    if diffusion_only:
        raise UsageError(f"{', '.join(diffusion_only)} apply to masked diffusion models; this model decodes left "
                         "to right")
    if args.regex is not None and args.json_schema is not None:
        raise UsageError("--regex and --json-schema are exclusive: pass one grammar")
    if args.length_penalty != 1.0 and args.num_beams == 1:  # it would be ignored
        raise UsageError(f"--length-penalty {args.length_penalty} ranks beam-search hypotheses: it needs --num-beams > 1")
    grammar = None
    if args.regex is not None or args.json_schema is not None:
        from jaxlm.fileio import read_json
        from jaxlm.inference.grammar import compile_json_schema, compile_regex

        grammar = (compile_regex(args.regex, model.tokenizer) if args.regex is not None else
                   compile_json_schema(read_json(args.json_schema, what="JSON schema"), model.tokenizer))
    start = time.perf_counter()
    result = jaxlm.generate(
        model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, rng=args.seed, grammar=grammar, num_beams=args.num_beams,
        length_penalty=args.length_penalty, num_return_sequences=args.num_return_sequences,
    )
    elapsed = time.perf_counter() - start
    R = args.num_return_sequences
    for i, text in enumerate(result.texts):
        score = "" if result.beam_scores is None else f" (beam score {float(result.beam_scores[i]):.3f})"
        print(f"{args.prompt[i // R]!r} -> {text!r}{score}")
    n = int(result.lengths.sum())
    print(f"{n} tokens in {elapsed:.2f}s (including compilation)", file=sys.stderr)
    return result.texts


def _generate_diffusion(args: GenerateArgs, model, prompts: list) -> list[str]:
    """`run_generate` on a masked diffusion LM: `jaxlm.diffusion_generate` with
    ``gen_length = --max-new-tokens``."""
    import jaxlm

    causal_only = [flag for flag, used in (("--regex", args.regex is not None),
                                           ("--json-schema", args.json_schema is not None),
                                           ("--num-beams", args.num_beams != 1),
                                           ("--num-return-sequences", args.num_return_sequences != 1),
                                           ("--top-k", args.top_k is not None), ("--top-p", args.top_p is not None),
                                           ("--length-penalty", args.length_penalty != 1.0))
                   if used]
    if causal_only:
        raise UsageError(f"{', '.join(causal_only)} apply to left-to-right decoding; this model is a masked "
                         "diffusion LM (use --steps, --block-length, --threshold)")
    for flag, value in (("--edits-per-round", args.edits_per_round), ("--edit-threshold", args.edit_threshold)):
        if value is not None and not args.edit_rounds:
            raise UsageError(f"{flag} limits the edits of each edit round: it needs --edit-rounds R (R >= 1)")
    if args.threshold is not None and args.steps is not None:  # it would be dropped silently
        raise UsageError(f"--steps {args.steps} is not used with --threshold (each block takes the steps it needs)")
    steps = None if args.threshold is not None else (args.max_new_tokens if args.steps is None else args.steps)
    start = time.perf_counter()
    result = jaxlm.diffusion_generate(
        model, prompts, gen_length=args.max_new_tokens, steps=steps, block_length=args.block_length,
        threshold=args.threshold, temperature=args.temperature, rng=args.seed, edit_rounds=args.edit_rounds or 0,
        edits_per_round=args.edits_per_round, edit_threshold=args.edit_threshold,
        banned_tokens=() if model.config.delete_token_id is None else (model.config.delete_token_id,),
    )
    elapsed = time.perf_counter() - start
    for prompt, text in zip(args.prompt, result.texts):
        print(f"{prompt!r} -> {text!r}")
    edits = f" + {result.edit_rounds} edit rounds" if args.edit_rounds else ""
    print(f"masked diffusion: {result.steps} denoising steps{edits}, {result.forwards} forwards in {elapsed:.2f}s "
          "(including compilation)", file=sys.stderr)
    return result.texts


def run_convert(args: ConvertArgs) -> Path:
    from jaxlm.checkpoint import convert_checkpoint

    out = convert_checkpoint(args.src, args.dst, to=args.to, overwrite=args.overwrite, hint=_OVERWRITE_HINT)
    print(f"wrote {args.to} checkpoint to {out}")
    return out


def run_eval(args: EvalArgs) -> float:
    from jaxlm.eval import heldout_accuracy, heldout_pass_at_k

    for name in ("n", "batch_size", "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    if any(k < 1 for k in args.pass_at):
        raise UsageError(f"--pass-at {' '.join(map(str, args.pass_at))} is invalid: each k must be >= 1")
    if not args.temperature > 0:
        raise UsageError(f"--temperature={args.temperature} is invalid: pass@k samples need a temperature > 0")
    model = _load(args.model)
    result = heldout_accuracy(model, args.source, args.n, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, desc="eval", progress=True)
    name = type(args.source).__name__.lower()
    chance = args.source.chance_accuracy()
    print(f"{name}: exact-match accuracy {result.accuracy:.1%} on {result.n} held-out problems"
          + (f" (chance {chance:.2%})" if chance == chance else ""))  # NaN: the task has no chance level
    for s in result.samples[:5]:
        print(f"  {s['prompt']!r} -> {s['completion']!r} (reference {s['reference']!r})")
    if args.pass_at:
        sampled = heldout_pass_at_k(model, args.source, args.n, ks=sorted(set(args.pass_at)),
                                    temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                    batch_size=args.batch_size)
        print(f"{name}: " + ", ".join(f"pass@{k} {v:.1%}" for k, v in sampled.pass_at_k.items())
              + f" ({sampled.samples_per_problem} samples per problem at temperature {args.temperature:g})")
    return result.accuracy


def run_quantize(args: QuantizeArgs):
    from jaxlm.quant.apply import quantize_checkpoint

    if args.inner != "rtn" and args.method not in ("rtn", "hadamard", "wush"):
        raise UsageError(f"--inner {args.inner} applies to --method rtn|hadamard|wush (got --method {args.method})")
    if args.rank is not None and args.method != "twinquant":
        raise UsageError(f"--rank applies to --method twinquant only (got --method {args.method})")
    rank = args.rank
    if rank is not None and (not math.isfinite(rank) or rank <= 0):
        raise UsageError(f"--rank {rank} is invalid: an integer >= 1 or a fraction in (0, 1)")
    if rank is not None and rank >= 1:
        if rank != int(rank):
            raise UsageError(f"--rank {rank} is invalid: an integer >= 1 or a fraction in (0, 1)")
        rank = int(rank)
    for name in ("calibration_n", "eval_n"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 0")
    if args.calibration_n == 0 and (args.method in ("wush", "twinquant") or args.inner == "gptq"):
        needs = "--inner gptq" if args.inner == "gptq" else f"--method {args.method}"
        raise UsageError(f"--calibration-n=0 is invalid: {needs} needs calibration texts")
    report = quantize_checkpoint(
        args.model, args.out, method=args.method, fmt=args.format, inner=args.inner,
        weights_only=args.weights_only, rank=rank, task=args.task, calibration_n=args.calibration_n,
        eval_n=args.eval_n, overwrite=args.overwrite, overwrite_hint=_OVERWRITE_HINT, progress=True,
    )
    print(report.summary())
    return report


def run_compress(args: CompressArgs):
    from jaxlm.compress import A3Config
    from jaxlm.compress.apply import compress_checkpoint

    try:
        a3 = A3Config(components=args.components, budget=args.budget, qk_head_dim=args.qk_head_dim,
                      v_head_dim=args.v_head_dim, ffn_dim=args.ffn_dim, allocation=args.allocation,
                      qk_rope_refit=args.qk_rope_refit, qk_refit_rank=args.qk_refit_rank)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.calib < 1:
        raise UsageError(f"--calib={args.calib} is invalid: must be >= 1 (A^3 needs calibration texts)")
    if args.eval_n < 0:
        raise UsageError(f"--eval-n={args.eval_n} is invalid: must be >= 0")
    report = compress_checkpoint(args.model, args.out, method=args.method, a3=a3, task=args.task,
                                 calibration_n=args.calib, eval_n=args.eval_n, overwrite=args.overwrite,
                                 overwrite_hint=_OVERWRITE_HINT, progress=True)
    print(report.summary())
    return report


def run_edit(args: EditArgs) -> dict:
    from jaxlm.editing.benchmark import edit_checkpoint, markdown_table

    if args.out is not None and args.method == "all":
        raise UsageError("--out saves one edited model: pick one --method, not all")
    if args.report is not None and args.report.exists() and not args.overwrite:
        raise UsageError(f"--report {args.report} exists; {_OVERWRITE_HINT}")
    _distinct_outputs(report=args.report, out=args.out, requests=args.requests)
    # found only after the edit (the model saved): a directory, or a file where a parent must be
    _file_outputs(inside=("out", args.out), report=args.report)
    report, runs = edit_checkpoint(
        args.model, args.requests, method=args.method, batches=args.batches, corpus=args.corpus,
        corpus_size=args.corpus_size, capability=args.capability, capability_n=args.capability_n,
        gradient=args.gradient, locate=args.locate, out=args.out, overwrite=args.overwrite,
        overwrite_hint=_OVERWRITE_HINT, progress=True, length_normalized=args.length_normalized,
    )
    n = sum(1 for _ in open(args.requests, encoding="utf-8") if _.strip())
    print(f"{n} edits in {args.batches} batch(es) on {args.model}")
    print(markdown_table(runs, report["unedited"]))
    if args.report is not None:
        from jaxlm.fileio import atomic_write_json

        atomic_write_json(args.report, report)  # strict JSON: an unmeasured metric (NaN) is null
    if args.out is not None:
        print(f"edited model -> {args.out}")
    return report


def run_serve_stream(args: ServeStreamArgs):
    from trainers.serve_stream import serve_prompt_file

    _distinct_outputs(completions=args.completions, report=args.report, save_draft=args.save_draft,
                      prompts=args.prompts)
    # outputs inside the draft's directory were deleted by its save (exit 0)
    _file_outputs(inside=("save_draft", args.save_draft), completions=args.completions, report=args.report)
    if args.save_draft is not None and args.save_draft.exists() and not args.save_draft.is_dir():
        raise UsageError(f"--save-draft {args.save_draft} is a file: name a directory for the draft checkpoint")
    for flag in ("completions", "report", "save_draft"):  # before the "serving" line: the error comes first
        path = getattr(args, flag)
        if path is not None and path.exists() and not args.overwrite:
            raise UsageError(f"--{flag.replace('_', '-')} {path} exists; {_OVERWRITE_HINT}")

    spec = args.spec
    print(f"serving {args.prompts} in chunks of {spec.chunk_size}, draft adapted by {spec.method}; "
          f"{spec.num_draft_tokens} drafts per verify round", file=sys.stderr)

    def show(c) -> None:
        loss = "" if c.train_loss != c.train_loss else f", draft loss {c.train_loss:.3f}"
        print(f"chunk {c.index}: {c.prompts} prompts, {c.tokens_per_round:.2f} tokens/round, accept "
              f"{c.accept_rate:.1%}, {c.tokens_per_second:.1f} tok/s{loss}", file=sys.stderr)

    result = serve_prompt_file(args.model, args.draft, args.prompts, spec, completions=args.completions,
                               report=args.report, save_draft=args.save_draft, overwrite=args.overwrite,
                               hint=_OVERWRITE_HINT, callback=show)
    n = sum(c.prompts for c in result.chunks)
    print(f"{n} prompts: {result.mean('tokens_per_round'):.2f} tokens per verify round, "
          f"{result.mean('tokens_per_second'):.1f} tok/s while serving")
    if args.save_draft is not None:
        print(f"adapted draft -> {args.save_draft}")
    return result


def run_logprobs(args: LogprobsArgs) -> Path:
    from trainers.annotate import annotate_file

    if args.out.suffix != ".jsonl":  # before the model is loaded
        raise UsageError(f"--out {args.out}: `jaxlm logprobs` writes a .jsonl file")
    _distinct_outputs(out=args.out, data=args.data)
    _file_outputs(out=args.out)

    out = annotate_file(_load(args.model), args.data, args.out, as_=args.as_, top_k=args.top_k,
                        batch_size=args.batch_size, overwrite=args.overwrite)
    print(f"wrote {args.as_}_logprobs" + (f" and top-{args.top_k}" if args.top_k else "") + f" to {out}")
    return out


def run_judge(args: JudgeArgs) -> dict:
    from jaxlm.eval.judge import JudgeTemplate
    from trainers.judge_file import judge_file

    if not 0.0 < args.alpha < 1.0:
        raise ValueError(f"--alpha={args.alpha} must be in (0, 1)")
    if args.out.suffix != ".jsonl":
        raise UsageError(f"--out {args.out}: `jaxlm judge` writes a .jsonl file")
    # --out naming an input replaced it with the judged rows, even the labelled calibration set
    _distinct_outputs(out=args.out, pairs=args.pairs)  # (the inputs may be one file: calibrating on the pairs)
    _distinct_outputs(out=args.out, calibration=args.calibration)
    _file_outputs(out=args.out)
    template = JudgeTemplate() if args.prompt_format is None else JudgeTemplate(pairwise=args.prompt_format)
    summary = judge_file(_load(args.model), args.pairs, args.out, calibration=args.calibration, alpha=args.alpha,
                         template=template, both_orders=not args.one_order, batch_size=args.batch_size,
                         overwrite=args.overwrite)
    line = f"judged {summary['pairs']} pairs -> {args.out}"
    if args.calibration is not None:
        line += (f"; SCOPE threshold {summary['threshold']:.4g} at alpha={args.alpha} accepts "
                 f"{summary['accepted']} (calibration coverage {summary['calibration_coverage']:.2f})")
    print(line)
    return summary


def run_train(args: TrainArgs):
    from trainers.loop import train
    from trainers.recipes import load_config

    overrides = list(args.overrides) + (["trainer.multihost=true"] if args.multihost else [])
    result = train(load_config(args.config, overrides))
    print(f"finished at step {result.step}: {result.final_eval} -> {result.out_dir}")
    return result


def run_quickstart(args: QuickstartArgs):
    from trainers.quickstart import run_quickstart as quickstart

    if args.rl_steps is not None and args.rl_steps < 0:
        raise UsageError(f"--rl-steps={args.rl_steps} is invalid: must be >= 0 (0 skips GRPO)")
    if args.steps is not None and args.steps <= 0:
        raise UsageError(f"--steps={args.steps} is invalid: must be >= 1")
    return quickstart(steps=args.steps, out_dir=args.out, overrides=args.overrides, progress=args.progress,
                      rl_steps=args.rl_steps, rl_overrides=args.rl_overrides)


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


def _config_help(argv: list[str]) -> bool:
    """``jaxlm train CONFIG --help``: the config's keys with their types, defaults and
    descriptions (tyro's help of the config dataclass, the recipe's values as defaults)."""
    if len(argv) < 2 or argv[0] != "train" or not ({"--help", "-h"} & set(argv[1:])):
        return False
    positional = [a for a in argv[1:] if not a.startswith("-")]
    if not positional:
        return False
    from trainers.config_help import describe_config
    from trainers.recipes import load_config

    config = load_config(positional[0], [a for a in positional[1:] if "=" in a])
    print(describe_config(config, positional[0]))
    return True


def _parse(union, argv: list[str]):
    """tyro's parse; its help text (``-h``) printed without reStructuredText markup."""
    import contextlib
    import io

    kwargs = dict(args=argv, prog="jaxlm",
                  description="jaxlm: train, evaluate, decode, serve, convert, quantize, compress and edit models.")
    if not {"-h", "--help"} & set(argv):
        err = io.StringIO()
        columns = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "400"  # tyro's messages one line each
        try:
            with contextlib.redirect_stderr(err):
                return tyro.cli(union, **kwargs)
        except SystemExit as e:
            if e.code in (0, None):
                raise
            verb = next((a for a in argv if a in VERBS), None)
            print(f"jaxlm: error: {_usage_error(err.getvalue(), verb)}", file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            if columns is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = columns

    from trainers.config_help import plain

    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            return tyro.cli(union, **kwargs)
    finally:
        sys.stdout.write(plain(text.getvalue()))


def _usage_error(text: str, verb: str | None) -> str:
    """tyro's boxed parse error as at most two lines in the command's terms (its own
    ``__tyro-dummy-inner__`` name for a nested section becomes the section's flag)."""
    rule = set("─-━═ ")
    raw = [line.strip().strip("│").strip() for line in text.splitlines()]
    lines = []
    for i, line in enumerate(raw):
        if not line or line[0] in "╭╰" or set(line) <= rule or line.startswith(("For full helptext", "jaxlm ")) \
                or "--help" in line:
            continue
        if not any(raw[:i]) and i + 1 < len(raw) and raw[i + 1] and set(raw[i + 1]) <= rule:
            continue  # without a box (not a terminal), the title is the first line, above a rule
        lines.append(line)
    help_hint = f"see jaxlm {verb} --help" if verb else "see jaxlm --help"
    if not lines:
        return help_hint
    first, rest = lines[0], lines[1:]
    nested = re.match(r"Error parsing __tyro[\w-]*\.([\w.]+): (.*)", first)
    flag = re.match(r"Error parsing (--[\w.-]+): (.*)", first)
    if nested:
        first = f"--{nested.group(1).replace('_', '-')}: {nested.group(2)}"
    elif flag:
        first = f"{flag.group(1)}: {flag.group(2)}"
        about = [line for line in rest if not line.startswith("Argument helptext")]
        if about:
            return first + "\n" + " ".join(about)[:200]
    elif first.startswith("Unrecognized options:"):
        first = "unrecognized option(s): " + first[len("Unrecognized options:"):].strip()
        close = [line.split()[0] for line in rest if line.startswith("--")]
        if close:
            return first + "\nclosest: " + ", ".join(close)
    elif first.startswith("Missing from"):
        needed = [line.split()[0] for line in rest if not line.endswith("(required)")]  # names, not helptexts
        first = f"missing {', '.join(needed) or 'arguments'} (required by {first[len('Missing from '):].rstrip(':')})"
    return first + "\n" + help_hint


VERBS = {
    "quickstart": (QuickstartArgs, run_quickstart),
    "train": (TrainArgs, run_train),
    "eval": (EvalArgs, run_eval),
    "generate": (GenerateArgs, run_generate),
    "convert": (ConvertArgs, run_convert),
    "quantize": (QuantizeArgs, run_quantize),
    "compress": (CompressArgs, run_compress),
    "edit": (EditArgs, run_edit),
    "serve-stream": (ServeStreamArgs, run_serve_stream),
    "logprobs": (LogprobsArgs, run_logprobs),
    "judge": (JudgeArgs, run_judge),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if _config_help(argv):
            raise SystemExit(0)
    except ValueError as e:  # the config itself is invalid
        print(f"jaxlm: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    union = None
    for name, (args_type, _) in VERBS.items():
        entry = Annotated[args_type, tyro.conf.subcommand(name)]
        union = entry if union is None else union | entry
    cmd = _parse(union, argv)
    _quiet_logs()
    from jaxlm.fileio import DirectoryLockedError
    from trainers.checkpointing import CheckpointCorruptError
    from trainers.loop import TrainingDiverged

    run = next(fn for args_type, fn in VERBS.values() if isinstance(cmd, args_type))
    try:
        run(cmd)
    except TrainingDiverged as e:  # the run itself failed
        print(f"jaxlm: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except (ValueError, OSError, DirectoryLockedError, CheckpointCorruptError) as e:
        # bad arguments, configs, data files, checkpoints, or an output directory in use: the
        # message names the file or field and what to do
        print(f"jaxlm: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
