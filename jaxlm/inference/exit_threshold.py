"""WAVE's exit threshold chosen by decoding (`jaxlm.inference.early_exit`).

The teacher-forced calibration (`calibrate_exit_window`) scores each exit against the full
model on text whose every earlier token ran at full depth. At decode time an exited token's
skipped layers get keys and values propagated from its exit state, so later tokens see a
different context, and the agreement measured teacher-forced overstates the agreement of
decoded outputs. Here the window is kept and the threshold is the smallest one on a grid
whose greedy early-exit decoding of calibration prompts reproduces the full model's greedy
decoding on at least ``agreement`` of the sequences (``level="sequence"``: every token and
the length equal) or of the tokens (``level="token"``: position by position over the full
model's output).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxlm.inference.early_exit import DEFAULT_THRESHOLDS, Calibration, ExitWindow
from jaxlm.inference.sampler import generate

LEVELS = ("sequence", "token")


def decoded_agreement(full, exited) -> dict:
    """How far an early-exit greedy result reproduces the full model's (two
    `GenerateResult` s of the same prompts): the fraction of sequences equal in every
    token and in length, the fraction of the full model's tokens matched at their
    position, and the mean layers run per decoded token (after the first, which comes from
    the full-depth prefill)."""
    full_tokens, full_lengths = np.asarray(full.tokens), np.asarray(full.lengths)
    tokens, lengths = np.asarray(exited.tokens), np.asarray(exited.lengths)
    if full_tokens.shape != tokens.shape:
        raise ValueError(f"results differ in shape: {full_tokens.shape} and {tokens.shape}")
    B = full_tokens.shape[0]
    same_sequence = np.array([lengths[b] == full_lengths[b]
                              and np.array_equal(tokens[b, :lengths[b]], full_tokens[b, :full_lengths[b]])
                              for b in range(B)])
    column = np.arange(full_tokens.shape[1])[None, :]
    positions = column < full_lengths[:, None]
    total = int(positions.sum())
    # within the early-exit row too: its padding after an earlier stop is no token (a pad id
    # that the full model generated there counted as a match)
    generated = column < lengths[:, None]
    same_token = float(((tokens == full_tokens) & positions & generated).sum() / total) if total else 1.0
    layers = np.asarray(exited.exit_layers)
    decoded = np.concatenate([layers[b, 1:lengths[b]] for b in range(B)]) if B else np.zeros(0)
    return {"sequence": float(same_sequence.mean()) if B else 1.0, "token": same_token,
            "mean_layers": float(decoded.mean()) if decoded.size else float("nan")}


def calibrate_threshold_by_decoding(model, prompts, window: ExitWindow, *, max_new_tokens: int,
                                    agreement: float = 0.99, level: str = "sequence",
                                    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
                                    batch_size: int = 64, **generate_kwargs) -> Calibration:
    """The smallest threshold in ``thresholds`` at which greedy decoding of ``prompts`` with
    ``window``'s start, end and proxy vocabulary agrees with full-depth greedy decoding on at
    least ``agreement`` (at ``level``), else the largest threshold. Thresholds are tried in
    increasing order until one passes (each is a compilation); ``sweep`` lists those tried.
    ``generate_kwargs`` go to `jaxlm.generate` (e.g. ``stop_tokens``, ``tokenizer``).
    ``settled`` is empty (no teacher-forced statistics are computed here)."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is invalid: must be one of {LEVELS}")
    if not 0 <= agreement <= 1:
        raise ValueError(f"agreement={agreement!r} is invalid: must be in [0, 1]")
    if not isinstance(window, ExitWindow):
        raise TypeError(f"window must be an ExitWindow, got {type(window).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: need at least one calibration prompt")
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be an int >= 1")
    grid = sorted({float(t) for t in thresholds})
    if not grid:
        raise ValueError("thresholds is empty")
    for key in ("temperature", "early_exit"):
        if key in generate_kwargs:
            raise ValueError(f"{key}= is set by the calibration (greedy, with each candidate window)")

    def decode(early_exit):
        parts = [generate(model, prompts[i:i + batch_size], max_new_tokens=max_new_tokens, temperature=0,
                          early_exit=early_exit, **generate_kwargs) for i in range(0, len(prompts), batch_size)]
        return _Stacked(parts)

    full = decode(None)
    sweep, chosen = [], None
    for t in grid:
        candidate = dataclasses.replace(window, threshold=t)
        scores = decoded_agreement(full, decode(candidate))
        sweep.append({"threshold": t, "agreement": scores[level], **{k: v for k, v in scores.items() if k != level},
                      "level": level})
        if scores[level] >= agreement:
            chosen = sweep[-1]
            break
    best = chosen if chosen is not None else sweep[-1]
    return Calibration(window=dataclasses.replace(window, threshold=best["threshold"]), settled=np.zeros(0, np.int64),
                       agreement=best["agreement"], mean_layers=best["mean_layers"], sweep=sweep)


class _Stacked:
    """Several batches' results seen as one (rows concatenated; all share ``max_new_tokens``)."""

    def __init__(self, parts):
        cat = lambda name: None if getattr(parts[0], name) is None else np.concatenate(  # noqa: E731
            [np.asarray(getattr(p, name)) for p in parts])
        self.tokens, self.lengths, self.exit_layers = cat("tokens"), cat("lengths"), cat("exit_layers")
