"""The ``jaxlm`` command line (arguments parsed and type-checked by `tyro`).

    jaxlm generate --prompt "12+30=" [--model DIR] [--max-new-tokens 32] [--temperature 0]
    jaxlm convert SRC DST [--to orbax|hf]

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


def main(argv: list[str] | None = None) -> None:
    cmd = tyro.cli(
        Annotated[GenerateArgs, tyro.conf.subcommand("generate")]
        | Annotated[ConvertArgs, tyro.conf.subcommand("convert")],
        args=argv,
        prog="jaxlm",
    )
    from jaxlm.models.hf.io import CheckpointError

    try:
        if isinstance(cmd, GenerateArgs):
            run_generate(cmd)
        else:
            run_convert(cmd)
    except (CheckpointError, ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"jaxlm: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
