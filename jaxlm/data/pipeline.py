"""From a data source to training batches, through `grain`.

Each example is encoded to ``tokens`` and ``loss_mask`` (`jaxlm.data.encoding.encode`:
the prompt is not trained, the completion and EOS are; chat ``messages`` are rendered in the
tokenizer's chat format and the assistant output is trained); batches are

    tokens      int32 [B, T]
    loss_mask   bool  [B, T]  token t is a training target
    segment_ids int32 [B, T]  document id within the row, 0 = padding
    positions   int32 [B, T]  position within the document

with ``pack=True`` several documents share a row (grain's first-fit packing) and the
model sees a block-diagonal causal mask (`jaxlm.models.masks.segment_mask`). The
training iterator's state (``get_state()``) is the data position a checkpoint stores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Callable

import grain
import numpy as np

from jaxlm.data.conditioned import ConditionedDigits
from jaxlm.data.encoding import encode
from jaxlm.data.facts import FactWorld
from jaxlm.data.files import TOKEN_FIELDS, TOPK_FIELDS, DataError, Files, read_rows_located
from jaxlm.data.graphs import GraphLabels
from jaxlm.data.mixture import Mixture
from jaxlm.data.polarity import Polarity
from jaxlm.data.regression import LongTailedRegression
from jaxlm.data.tasks import Arithmetic, Countdown, MarkovText, Sorting, Task

log = logging.getLogger(__name__)

Source = (
    Arithmetic | Countdown | Sorting | MarkovText | GraphLabels | ConditionedDigits | LongTailedRegression
    | FactWorld | Polarity | Mixture | Files
)
_ENDLESS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to train on and how it is batched."""

    source: Source = Arithmetic()
    """Where examples come from: a synthetic task (generated from its seed) or local Files."""
    seq_len: int = 64
    """Tokens per row; a longer example is an error (synthetic) or dropped with a count (files)."""
    batch_size: int = 32
    """Rows per step, over all processes and devices (GRPO: prompts per iteration)."""
    pack: bool = False
    """Pack several examples per row (block-diagonal causal mask) instead of one padded example."""
    shuffle_seed: int = 0
    """Seed of the data order (files, packing)."""
    eval_examples: int = 200
    """Held-out examples for the loss and the accuracy."""

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "eval_examples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DataConfig.{name}={v!r} is invalid: must be a positive int")
        v = self.shuffle_seed
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:  # grain's shuffles take seeds >= 0
            raise ValueError(f"DataConfig.shuffle_seed={v!r} is invalid: must be an int >= 0")


class ExampleSource:
    """Random-access examples of one split, and the verifier when the source has one."""

    def __init__(self, source: Source, split: str):
        self.source, self.split = source, split
        if isinstance(source, Files):
            rows, where = read_rows_located(source.path)
            if source.eval_path is not None:
                rows, where = read_rows_located(source.eval_path) if split == "eval" else (rows, where)
            else:
                def held_out(i):
                    h = hashlib.blake2b(str(i).encode(), digest_size=8).digest()
                    return int.from_bytes(h, "little") % 10_000 < source.eval_fraction * 10_000

                keep = [i for i in range(len(rows)) if held_out(i) == (split == "eval")]
                rows, where = [rows[i] for i in keep], [where[i] for i in keep]
            if not rows:
                raise DataError(f"{source.path}: the {split} split is empty")
            self._rows, self.row_where = rows, where  # row_where: each row's file:line, for errors
        else:
            self._rows, self.row_where = None, None

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else _ENDLESS

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._rows is not None:
            return self._rows[index % len(self._rows)]
        return self.source.example(int(index), self.split)

    @property
    def verify(self) -> Callable[[dict, str], float] | None:
        return self.source.verify if isinstance(self.source, Task) else None


def _pad(example: dict[str, np.ndarray], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One example -> fixed-length row. Optional fields a task may provide: ``positions``
    ``[n]`` or ``[n, 2]`` (graph coordinates), ``attn_mask [n, n]`` (padding keys hidden)."""
    n = len(example["tokens"])
    tokens = np.full(seq_len, pad_id, np.int32)
    tokens[:n] = example["tokens"]
    mask = np.zeros(seq_len, bool)
    mask[:n] = example["loss_mask"]
    seg = np.zeros(seq_len, np.int32)
    seg[:n] = 1
    out = {"tokens": tokens, "loss_mask": mask, "segment_ids": seg}
    if "positions" in example:
        pos = np.zeros((seq_len,) + example["positions"].shape[1:], np.int32)
        pos[:n] = example["positions"]
        out["positions"] = pos
    else:
        out["positions"] = np.where(seg > 0, np.arange(seq_len), 0).astype(np.int32)
    if "attn_mask" in example:
        am = np.zeros((seq_len, seq_len), bool)
        am[:n, :n] = example["attn_mask"]
        out["attn_mask"] = am
    for key in TOKEN_FIELDS + TOPK_FIELDS:  # per-token columns, zero on padding
        if key in example:
            v = example[key]
            padded = np.zeros((seq_len,) + v.shape[1:], v.dtype)
            padded[:n] = v
            out[key] = padded
    for key in ("condition", "condition_mask"):  # fixed-width already
        if key in example:
            out[key] = example[key]
    return out


def _checked_encode(tokenizer, seq_len: int, source=None):
    custom = getattr(source, "encode_arrays", None)

    def fn(example):
        enc = custom(example, tokenizer) if custom is not None else encode(example, tokenizer)
        if len(enc["tokens"]) > seq_len:
            raise DataError(
                f"an example encodes to {len(enc['tokens'])} tokens > DataConfig.seq_len={seq_len}: "
                f"raise data.seq_len (example prompt: {example.get('prompt', '')[:60]!r})"
            )
        return enc

    return fn


def _encoded_split(cfg: DataConfig, tokenizer, split: str) -> grain.MapDataset:
    """Encoded examples of a split. File rows are encoded up front; rows longer than
    ``seq_len`` are dropped and counted in the log (an error if none is left)."""
    examples = ExampleSource(cfg.source, split)
    if examples._rows is None:
        return grain.MapDataset.source(examples).map(_checked_encode(tokenizer, cfg.seq_len, cfg.source))
    encoded = []
    for r, where in zip(examples._rows, examples.row_where):
        try:
            encoded.append(encode(r, tokenizer))
        except Exception as e:  # noqa: BLE001 (a bad row or a template that refuses it: name the row)
            message = str(e) if isinstance(e, DataError) else f"{type(e).__name__}: {e}"
            raise DataError(f"{where} ({split} split): {message}") from None
    kept = [e for e in encoded if len(e["tokens"]) <= cfg.seq_len and e["loss_mask"].any()]
    dropped = len(encoded) - len(kept)
    if dropped:
        log.warning(
            "%s (%s split): dropped %d of %d rows longer than seq_len=%d or with nothing to train",
            cfg.source.path, split, dropped, len(encoded), cfg.seq_len,
        )
    if not kept:
        raise DataError(f"{cfg.source.path}: no {split} row fits seq_len={cfg.seq_len}")
    return grain.MapDataset.source(kept)


def train_dataset(cfg: DataConfig, tokenizer, *, shard_index: int = 0, shard_count: int = 1) -> grain.IterDataset:
    """Endless shuffled training batches (this process's shard when multi-host)."""
    ds = _encoded_split(cfg, tokenizer, "train")
    if isinstance(cfg.source, Files):
        ds = ds.shuffle(seed=cfg.shuffle_seed).repeat()
    ds = ds[shard_index::shard_count]
    pad_id = tokenizer.pad_id
    if cfg.pack and hasattr(cfg.source, "encode_arrays"):
        raise ValueError(
            f"data.pack=True is not supported for {type(cfg.source).__name__}: its examples carry "
            f"their own positions/attention masks; set data.pack=false"
        )
    if cfg.pack:
        T = cfg.seq_len
        extra = [k for k in TOKEN_FIELDS + TOPK_FIELDS if len(ds) and k in ds[0]]
        packed = grain.experimental.FirstFitPackIterDataset(
            ds.to_iter_dataset(), length_struct={"tokens": T, "loss_mask": T, **{k: T for k in extra}},
            num_packing_bins=cfg.batch_size, seed=cfg.shuffle_seed, shuffle_bins=True,
        )

        def rename(x):
            return {
                "tokens": x["tokens"].astype(np.int32),
                "loss_mask": x["loss_mask"].astype(bool),
                "segment_ids": x["tokens_segment_ids"].astype(np.int32),
                "positions": x["tokens_positions"].astype(np.int32),
                **{k: x[k] for k in extra},
            }

        it = packed.map(rename)
    else:
        it = ds.map(lambda e: _pad(e, cfg.seq_len, pad_id)).to_iter_dataset()
    return it.batch(cfg.batch_size, drop_remainder=True)


def eval_batches(cfg: DataConfig, tokenizer) -> list[dict[str, np.ndarray]]:
    """The first ``eval_examples`` held-out examples as padded batches (last one filled
    with empty rows, which carry no loss)."""
    ds = _encoded_split(cfg, tokenizer, "eval")
    n = min(cfg.eval_examples, len(ds))
    rows = [_pad(ds[i], cfg.seq_len, tokenizer.pad_id) for i in range(n)]
    empty = {k: np.zeros_like(v) for k, v in rows[0].items()}
    rows += [empty] * (-len(rows) % cfg.batch_size)
    return [
        {k: np.stack([r[k] for r in rows[i : i + cfg.batch_size]]) for k in rows[0]}
        for i in range(0, len(rows), cfg.batch_size)
    ]


def eval_examples(cfg: DataConfig) -> tuple[list[dict[str, Any]], Callable | None]:
    """Held-out raw examples (for generation-based accuracy) and the verifier, if any (None
    for sources without one, or whose layout `generate` cannot reproduce)."""
    src = ExampleSource(cfg.source, "eval")
    n = min(cfg.eval_examples, len(src))
    verify = src.verify if getattr(cfg.source, "generative_eval", True) else None
    return [src[i] for i in range(n)], verify
