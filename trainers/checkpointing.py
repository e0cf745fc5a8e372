"""Training checkpoints: an orbax `CheckpointManager` (keep-N, async) over the whole
`TrainState` (params, optimizer state, step, rng) plus the data iterator's position and
the experiment config, so a restarted run continues bit-identically.

Each checkpoint also stores a digest of its arrays (SHA-256 of every leaf's bytes, with
its shape and dtype) and of its JSON items, computed from the state at save time and
checked on restore. `TrainCheckpointer.restore_verified` resumes from the newest
checkpoint that restores and matches its digest, moving the others to ``corrupt/`` and
naming each by path and step; `CheckpointCorruptError` when none does.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxlm.checkpoint import orbax_error_summary, quiet_orbax_read_errors

log = logging.getLogger(__name__)

DIGEST_ITEM = "digest"
DIGEST_FORMAT = 1


class CheckpointCorruptError(RuntimeError):
    """A training checkpoint does not restore, or its arrays do not match their digest.

    ``failures``: ``(step, path, reason)`` for every checkpoint tried. ``checked``: the
    steps whose stored structure matched the requested state (so a failure is damage, not
    a different model or optimizer).
    """

    def __init__(self, message: str, *, failures: list[tuple[int, Path, str]], checked: tuple[int, ...] = ()):
        super().__init__(message)
        self.failures = failures
        self.checked = checked


class CheckpointMismatchError(ValueError):
    """A checkpoint holds other arrays (names, shapes, dtypes) than the state restored into
    it: a different config, not damage; it is never moved aside."""


def _structure_mismatch(digest: dict[str, Any], abstract_state) -> str | None:
    """How the arrays a digest describes differ from ``abstract_state`` (None: they match)."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    want = {_leaf_name(p): x for p, x in leaves}
    if digest.get("scope") == "global":
        stored = digest.get("leaves", {})
    else:
        stored = {n: None for n in digest.get("leaf_names", [])}
    missing, extra = sorted(set(stored) - set(want)), sorted(set(want) - set(stored))
    if missing or extra:
        return f"the checkpoint has leaves {missing[:4]} that the state lacks and lacks {extra[:4]}"
    for name, x in want.items():
        meta = stored[name]
        if meta is None or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue
        got = (tuple(meta["shape"]), meta["dtype"])
        expected = (tuple(x.shape), str(np.dtype(x.dtype)))
        if got != expected:
            return f"{name} is stored as {got[1]}{list(got[0])}, the state has {expected[1]}{list(expected[0])}"
    return None


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path)


def _host_bytes(x) -> tuple[np.ndarray, str]:
    """A leaf as a contiguous host array (typed PRNG keys as their key data) and its dtype name."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(jax.device_get(x))
    return a, str(a.dtype)


def _sha256(a: np.ndarray) -> str:
    """SHA-256 of an array's bytes in C order."""
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8) if a.size else b"").hexdigest()


def _json_digest(value: Any) -> str | None:
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _global_leaf_digest(x) -> dict[str, Any]:
    a, dtype = _host_bytes(x)
    return {"shape": list(a.shape), "dtype": dtype, "sha256": _sha256(a)}


def _local_leaf_digest(x) -> tuple[str, str]:
    """(digest of this process's replica-0 shards, fingerprint of their indices)."""
    if not isinstance(x, jax.Array):
        a, _ = _host_bytes(x)
        return (_sha256(a) if jax.process_index() == 0 else hashlib.sha256(b"").hexdigest()), "host"
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    shards = sorted((s for s in x.addressable_shards if s.replica_id == 0),
                    key=lambda s: tuple((i.start or 0) for i in s.index))
    h, layout = hashlib.sha256(), hashlib.sha256()
    for s in shards:
        index = repr(tuple((i.start, i.stop) for i in s.index)).encode()
        a = np.asarray(s.data)
        h.update(index)
        h.update(_sha256(a).encode())
        layout.update(index)
    return h.hexdigest(), layout.hexdigest()


def state_digest(state) -> dict[str, Any]:
    """Digest of a pytree of arrays, for storing beside it.

    One process: SHA-256 of each whole leaf (as `jax.device_get` returns it) with its
    shape and dtype, keyed by the leaf's path; independent of the sharding. Several
    processes: each process hashes the replica-0 shards it holds, per leaf; the per-
    process digests (and a fingerprint of the shard layout) are gathered to every
    process, so a restore on the same process/shard layout checks each process's shards.
    """
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    names = [_leaf_name(p) for p, _ in leaves]
    workers = min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # hashlib releases the GIL
        if jax.process_count() == 1:
            digests = list(pool.map(lambda kv: _global_leaf_digest(kv[1]), leaves))
            return {"format": DIGEST_FORMAT, "algorithm": "sha256", "scope": "global",
                    "leaves": dict(zip(names, digests))}
        local = list(pool.map(lambda kv: _local_leaf_digest(kv[1]), leaves))
    digest_rows = np.frombuffer(b"".join(bytes.fromhex(d) for d, _ in local), np.uint8).reshape(len(local), 32)
    layout = hashlib.sha256("".join(f for _, f in local).encode()).digest()
    gathered = np.asarray(multihost_utils.process_allgather(digest_rows))
    layouts = np.asarray(multihost_utils.process_allgather(np.frombuffer(layout, np.uint8)))
    return {
        "format": DIGEST_FORMAT, "algorithm": "sha256", "scope": "process",
        "process_count": jax.process_count(), "leaf_names": names,
        "processes": [{"leaves": [bytes(r).hex() for r in gathered[i]], "layout": bytes(layouts[i]).hex()}
                      for i in range(jax.process_count())],
    }


def verify_digest(state, stored: dict[str, Any]) -> list[str]:
    """Mismatches between ``state`` and a `state_digest` (empty when it verifies). A
    multi-process digest restored on another process count or shard layout cannot be
    checked: that is logged and counts as verified."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    names = [_leaf_name(p) for p, _ in leaves]
    if stored.get("format") != DIGEST_FORMAT:
        return [f"unknown digest format {stored.get('format')!r}"]
    problems: list[str] = []
    if stored.get("scope") == "global":
        want = stored.get("leaves", {})
        if sorted(want) != sorted(names):
            missing, extra = sorted(set(want) - set(names)), sorted(set(names) - set(want))
            return [f"the restored state's leaves differ from the digest's (missing {missing[:4]}, extra {extra[:4]})"]
        with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            got = list(pool.map(lambda kv: _global_leaf_digest(kv[1]), leaves))
        for name, g in zip(names, got):
            w = want[name]
            if g != {"shape": list(w["shape"]), "dtype": w["dtype"], "sha256": w["sha256"]}:
                what = "shape/dtype" if (g["shape"], g["dtype"]) != (list(w["shape"]), w["dtype"]) else "bytes"
                problems.append(f"{name}: {what} differ from the digest")
        return problems
    # per-process digests
    if stored.get("process_count") != jax.process_count() or stored.get("leaf_names") != names:
        log.warning("checkpoint digest was written by %s processes with another state layout; not verified",
                    stored.get("process_count"))
        return []
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        local = list(pool.map(lambda kv: _local_leaf_digest(kv[1]), leaves))
    mine = stored["processes"][jax.process_index()]
    layout = hashlib.sha256("".join(f for _, f in local).encode()).hexdigest()
    if layout != mine["layout"]:
        log.warning("process %d restored another shard layout than it saved; digest not verified",
                    jax.process_index())
    else:
        problems = [f"{n}: bytes of process {jax.process_index()}'s shards differ from the digest"
                    for n, (d, _), w in zip(names, local, mine["leaves"]) if d != w]
    bad = np.asarray(multihost_utils.process_allgather(np.int32(len(problems))))
    if not problems and bad.sum():
        problems = [f"shards of process(es) {np.nonzero(bad)[0].tolist()} differ from the digest"]
    return problems


class TrainCheckpointer:
    """keep-N (async) orbax checkpoints of a run, each with a digest of its arrays.

    The harness calls `restore_verified` once at start (None: no checkpoint, start
    fresh), `save` at its save steps and `close` at the end; `stored_config` reads the
    config saved with a step (for when ``config.json`` is unreadable).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
                 digest: bool = True):
        """digest: store a digest with each save (costs one extra host copy and a SHA-256
        pass over the state, per leaf and in threads); restores verify whatever digest a
        checkpoint has either way."""
        self.directory = Path(directory).absolute()
        self.digest = digest
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data", "config", DIGEST_ITEM),
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state, data_state: dict[str, Any], config: dict[str, Any]) -> None:
        """Save ``state`` (async: it returns once the arrays are copied to the host) with
        the digest of its arrays, of ``data_state`` and of ``config``."""
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data_state),
                 "config": ocp.args.JsonSave(config)}
        if self.digest:
            digest = state_digest(state)
            digest["data_sha256"] = _json_digest(data_state)
            digest["config_sha256"] = _json_digest(config)
            items[DIGEST_ITEM] = ocp.args.JsonSave(digest)
        if not self._mngr.save(step, args=ocp.args.Composite(**items)):
            # orbax declines a step at or below one it lists: losing the save silently would
            # leave the run without the checkpoint it believes it has
            raise RuntimeError(f"checkpoint step {step} was not saved: {self.directory} already holds step "
                               f"{self.latest_step()}, and orbax saves only newer steps")

    def restore(self, step: int, abstract_state) -> tuple[Any, dict[str, Any]]:
        """Restore step ``step`` into ``abstract_state`` (ShapeDtypeStructs with shardings)
        and check it against its digest; `CheckpointCorruptError` naming the path and step
        when it does not restore or does not match. A checkpoint without a digest (older
        jaxlm) is restored unchecked."""
        path = self.step_path(step)
        has_digest = (path / DIGEST_ITEM).is_dir()
        checked: tuple[int, ...] = ()
        digest: dict[str, Any] = {}
        if has_digest:
            try:
                digest = self._mngr.restore(step, args=ocp.args.Composite(**{DIGEST_ITEM: ocp.args.JsonRestore()}))[
                    DIGEST_ITEM]
            except Exception as e:
                reason = orbax_error_summary(e)
                raise CheckpointCorruptError(f"checkpoint step {step} at {path}: its digest could not be read "
                                             f"({reason})", failures=[(step, path, reason)]) from e
            mismatch = _structure_mismatch(digest, abstract_state)
            if mismatch is not None:
                raise CheckpointMismatchError(
                    f"checkpoint step {step} at {path} holds other arrays than this run's state ({mismatch}): "
                    f"the model or optimizer config differs from the run that wrote it"
                )
            checked = (step,)
        items = {"state": ocp.args.StandardRestore(abstract_state), "data": ocp.args.JsonRestore()}
        reason = None
        with quiet_orbax_read_errors():
            try:
                restored = self._mngr.restore(step, args=ocp.args.Composite(**items))
            except Exception as e:  # orbax/tensorstore raise bare Exception on unreadable files
                reason = orbax_error_summary(e)  # (not chained: its frames hold orbax's pending reads)
        if reason is not None:
            raise CheckpointCorruptError(
                f"checkpoint step {step} at {path} could not be read ({reason})",
                failures=[(step, path, reason)], checked=checked,
            )
        state, data = restored["state"], restored["data"]
        if not has_digest:
            log.warning("checkpoint step %d at %s has no digest (written by an older jaxlm): restored "
                        "without verification", step, path)
            return state, data
        problems = verify_digest(state, digest)
        if digest.get("data_sha256") not in (None, _json_digest(data)):
            problems.append("the data iterator state differs from its digest")
        if problems:
            reason = "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
            raise CheckpointCorruptError(
                f"checkpoint step {step} at {path} is corrupt: {reason}", failures=[(step, path, reason)],
                checked=checked,
            )
        return state, data

    def restore_verified(self, abstract_state, *, max_step: int | None = None,
                         quarantine: bool = True) -> tuple[int, Any, dict[str, Any]] | None:
        """The newest checkpoint (at most ``max_step``) that restores and matches its
        digest, as ``(step, state, data_state)``; None when there is no checkpoint.

        Each checkpoint that fails is logged by path and step and, with ``quarantine``,
        moved to ``<directory>/corrupt/<step>.<time>`` (so the run can save that step
        again) when an older one restores; when none does, only those whose digest showed
        the same structure as ``abstract_state`` are moved. Raises
        `CheckpointCorruptError` naming every path tried when none verifies, and
        `CheckpointMismatchError` (before trying older steps) when a checkpoint holds
        other arrays than ``abstract_state``: check the config before restoring.
        """
        self.wait()
        steps = sorted((s for s in self.all_steps() if max_step is None or s <= max_step), reverse=True)
        if not steps:
            return None
        failures: list[tuple[int, Path, str]] = []
        damaged: list[int] = []
        for step in steps:
            try:
                state, data = self.restore(step, abstract_state)
            except CheckpointCorruptError as e:
                failures.extend(e.failures)
                damaged.extend(e.checked)
                log.error("%s; trying an older checkpoint", e)
                continue
            if failures:
                if quarantine:  # every newer failed step: orbax saves no step at or below one it lists
                    self._quarantine([s for s, _, _ in failures])
                log.warning("resuming from checkpoint step %d at %s (newer checkpoint(s) %s failed)",
                            step, self.step_path(step), ", ".join(str(s) for s, _, _ in failures))
            return step, state, data
        if quarantine:
            self._quarantine(damaged)
        listed = "; ".join(f"step {s} at {p}: {r}" for s, p, r in failures)
        moved = (f"Those with a digest were moved to {self.directory / 'corrupt'}. "
                 if quarantine and damaged else "")
        raise CheckpointCorruptError(
            f"no checkpoint in {self.directory} restores and verifies ({listed}). {moved}"
            "Start the run in a new trainer.out_dir, or restore a copy of a good checkpoint.",
            failures=failures, checked=tuple(damaged),
        )

    def _quarantine(self, steps: list[int]) -> None:
        """Move failed steps out of orbax's view (into ``corrupt/``), on process 0."""
        if not steps:
            return
        if jax.process_index() == 0:
            target = self.directory / "corrupt"
            target.mkdir(exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            for step in steps:
                src = self.step_path(step)
                if src.exists():
                    dst = target / f"{step}.{stamp}"
                    os.rename(src, dst)
                    log.warning("moved corrupt checkpoint step %d to %s", step, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxlm.quarantine:{self.directory}")
        self._mngr.reload()

    def stored_config(self, step: int) -> dict[str, Any]:
        """The experiment config saved with checkpoint ``step`` (checked against its
        digest when it has one)."""
        path = self.step_path(step)
        items = {"config": ocp.args.JsonRestore()}
        if (path / DIGEST_ITEM).is_dir():
            items[DIGEST_ITEM] = ocp.args.JsonRestore()
        try:
            restored = self._mngr.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            reason = orbax_error_summary(e)
            raise CheckpointCorruptError(f"the config of checkpoint step {step} at {path} could not be read "
                                         f"({reason})", failures=[(step, path, reason)]) from e
        config = restored["config"]
        want = restored[DIGEST_ITEM].get("config_sha256") if DIGEST_ITEM in items else None
        if want is not None and want != _json_digest(config):
            reason = "the stored config differs from its digest"
            raise CheckpointCorruptError(f"checkpoint step {step} at {path}: {reason}",
                                         failures=[(step, path, reason)])
        return config

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
