"""`jaxlm serve-stream`: OnlineSPEC over a jsonl file of prompts (`jaxlm.inference.online_spec`).

Loads the target and the draft, serves the prompts in file order in chunks of
``config.chunk_size`` with speculative decoding, adapts the draft between chunks, and writes
what was asked for: each row with its ``completion`` and ``tokens`` (jsonl), the per-chunk
report with the config (JSON), the adapted draft (a jaxlm checkpoint). Files are replaced
atomically; the draft's directory is locked while it is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

from jaxlm.checkpoint import load_model, save_checkpoint
from jaxlm.data.files import read_prompts
from jaxlm.fileio import DirectoryLock, atomic_write_text
from jaxlm.inference.online_spec import ChunkReport, OnlineSpecConfig, StreamReport, chunked, serve_stream


def _finite(v):
    return None if isinstance(v, float) and v != v else v  # a static draft has no loss (NaN) -> null


def report_json(result: StreamReport) -> dict:
    """The config, each chunk's measurements (NaN as null) and the pooled means."""
    chunks = [{k: _finite(v) for k, v in dataclasses.asdict(c).items() if k != "completions"} for c in result.chunks]
    return {"config": dataclasses.asdict(result.config), "chunks": chunks,
            "tokens_per_round": result.mean("tokens_per_round"),
            "tokens_per_second": result.mean("tokens_per_second")}


def serve_prompt_file(model: str | os.PathLike, draft: str | os.PathLike, prompts: str | os.PathLike,
                      config: OnlineSpecConfig, *, completions: str | os.PathLike | None = None,
                      report: str | os.PathLike | None = None, save_draft: str | os.PathLike | None = None,
                      overwrite: bool = False, hint: str = "pass overwrite=True to replace it",
                      callback: Callable[[ChunkReport], None] | None = None) -> StreamReport:
    """Serve ``prompts`` (jsonl rows with a ``prompt``) with ``model`` and ``draft``
    (checkpoint or HF directories) and write the requested outputs (module docstring)."""
    rows = read_prompts(prompts)
    save_draft = None if save_draft is None else Path(save_draft)
    for output in (completions, report, save_draft):  # refused before any work, not after it
        if output is not None and Path(output).exists() and not overwrite:
            raise FileExistsError(f"{output} exists; {hint}")
    target, small = load_model(model), load_model(draft)
    if target.tokenizer is None:
        raise ValueError(f"{model} has no tokenizer (tokenizer.json); cannot encode text prompts")
    # every prompt must fit both models with its completion (and the drafts), checked before
    # any chunk is served and the draft trained
    limits = [("the target", target.config.max_seq_len, 0)]
    if hasattr(small, "config"):
        limits.append(("the draft", small.config.max_seq_len, config.num_draft_tokens))
    for i, row in enumerate(rows):
        n = len(target.tokenizer.encode(row["prompt"], add_bos=True))
        for what, limit, extra in limits:
            if n + config.max_new_tokens + extra > limit:
                raise ValueError(f"{prompts}: prompt {i + 1} has {n} tokens; with max_new_tokens={config.max_new_tokens}"
                                 f"{f' and {extra} draft tokens' if extra else ''} it exceeds {what}'s "
                                 f"ModelConfig.max_seq_len={limit}")
    result = serve_stream(target, small, chunked([r["prompt"] for r in rows], config.chunk_size), config,
                          keep_completions=True, callback=callback)
    if completions is not None:
        ids = [c for chunk in result.chunks for c in chunk.completions]
        lines = [json.dumps({**row, "completion": target.tokenizer.decode(t), "tokens": t}, ensure_ascii=False)
                 for row, t in zip(rows, ids)]
        Path(completions).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(completions, "\n".join(lines) + "\n")
    if report is not None:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(report, json.dumps(report_json(result), indent=2, allow_nan=False))
    if save_draft is not None:
        with DirectoryLock(save_draft, beside=True, what="draft being written"):
            save_checkpoint(result.draft, save_draft, overwrite=overwrite)
    return result
