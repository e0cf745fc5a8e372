"""Training checkpoints carry a digest of their arrays: flipped bits and truncated files
are reported by path and step, and resume falls back to the newest checkpoint that
verifies."""

import logging
import random
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers.checkpointing import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    TrainCheckpointer,
    abstract_like,
    state_digest,
    verify_digest,
)


def _state(k: int):
    key = jax.random.key(k)
    return {
        "params": {"w": jax.random.normal(key, (96, 64)), "b": jnp.full((64,), float(k))},
        "opt": {"mu": jax.random.normal(jax.random.fold_in(key, 1), (96, 64), jnp.bfloat16)},
        "step": jnp.int32(k),
        "rng": jax.random.key_data(jax.random.fold_in(key, 2)),
    }


def _save_steps(directory: Path, steps=(1, 2, 3)):
    ckpt = TrainCheckpointer(directory, keep=5, async_save=True)
    for s in steps:
        ckpt.save(s, _state(s), {"position": s}, {"optimizer": {"lr": 1e-3}})
    ckpt.close()


def _array_files(step_dir: Path) -> list[Path]:
    """tensorstore/OCDBT data files of a step's state, largest first."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no OCDBT data files under {step_dir}"
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def _flip_bits(path: Path, n: int, seed: int) -> None:
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    for _ in range(n):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _assert_tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flipped_bits_are_detected_and_resume_falls_back(tmp_path, caplog, seed):
    _save_steps(tmp_path)
    for f in _array_files(tmp_path / "3"):
        _flip_bits(f, 4, seed)
    ckpt = TrainCheckpointer(tmp_path, keep=5)
    abstract = abstract_like(_state(0))
    with pytest.raises(CheckpointCorruptError, match=rf"checkpoint step 3 at {tmp_path / '3'} "):
        ckpt.restore(3, abstract)
    with caplog.at_level(logging.WARNING, logger="trainers.checkpointing"):
        step, state, data = ckpt.restore_verified(abstract)
    assert step == 2 and data == {"position": 2}
    _assert_tree_equal(state, _state(2))
    assert f"checkpoint step 3 at {tmp_path / '3'}" in caplog.text
    # moved aside, so the resumed run can write step 3 again
    assert ckpt.all_steps() == [1, 2]
    assert [p.name.split(".")[0] for p in (tmp_path / "corrupt").iterdir()] == ["3"]
    ckpt.save(3, _state(3), {"position": 3}, {})
    ckpt.wait()
    _assert_tree_equal(ckpt.restore(3, abstract)[0], _state(3))
    ckpt.close()


def test_truncated_array_file_gives_a_clear_error(tmp_path):
    _save_steps(tmp_path, steps=(1, 2))
    big = _array_files(tmp_path / "2")[0]
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    ckpt = TrainCheckpointer(tmp_path, keep=5)
    abstract = abstract_like(_state(0))
    with pytest.raises(CheckpointCorruptError, match=rf"checkpoint step 2 at {tmp_path / '2'} could not be read "
                                                     r"\(ValueError: OUT_OF_RANGE"):
        ckpt.restore(2, abstract)  # orbax itself raises a bare Exception
    step, state, _ = ckpt.restore_verified(abstract)
    assert step == 1
    _assert_tree_equal(state, _state(1))
    ckpt.close()


def test_no_checkpoint_verifies_names_every_path(tmp_path):
    _save_steps(tmp_path, steps=(1, 2))
    for s in (1, 2):
        _flip_bits(_array_files(tmp_path / str(s))[0], 4, seed=s)
    ckpt = TrainCheckpointer(tmp_path, keep=5)
    with pytest.raises(CheckpointCorruptError) as err:
        ckpt.restore_verified(abstract_like(_state(0)))
    msg = str(err.value)
    assert f"step 2 at {tmp_path / '2'}" in msg and f"step 1 at {tmp_path / '1'}" in msg
    assert "no checkpoint" in msg and "moved to" in msg
    assert [s for s, _, _ in err.value.failures] == [2, 1]
    assert ckpt.restore_verified(abstract_like(_state(0))) is None  # nothing left to resume
    ckpt.close()


def test_max_step_config_and_checkpoints_without_digest(tmp_path, caplog):
    _save_steps(tmp_path)
    ckpt = TrainCheckpointer(tmp_path, keep=5)
    step, state, _ = ckpt.restore_verified(abstract_like(_state(0)), max_step=2)
    assert step == 2
    assert ckpt.stored_config(3) == {"optimizer": {"lr": 1e-3}}
    ckpt.close()
    shutil.rmtree(tmp_path / "3" / "digest")  # as written before digests were stored
    ckpt = TrainCheckpointer(tmp_path, keep=5)
    with caplog.at_level(logging.WARNING, logger="trainers.checkpointing"):
        step, state, _ = ckpt.restore_verified(abstract_like(_state(0)))
    assert step == 3 and "has no digest" in caplog.text
    _assert_tree_equal(state, _state(3))
    assert ckpt.stored_config(3) == {"optimizer": {"lr": 1e-3}}
    ckpt.close()
    unchecked = TrainCheckpointer(tmp_path / "nodigest", digest=False)
    unchecked.save(1, _state(1), {}, {})
    unchecked.close()
    assert not (tmp_path / "nodigest" / "1" / "digest").exists()


def test_digest_is_per_leaf_and_sharding_independent():
    state = _state(5)
    digest = state_digest(state)
    assert digest["scope"] == "global" and "['params']['w']" in digest["leaves"]
    assert digest["leaves"]["['opt']['mu']"]["dtype"] == "bfloat16"
    assert digest["leaves"]["['step']"]["shape"] == [] and digest["leaves"]["['rng']"]["shape"] == [2]
    assert verify_digest(jax.tree.map(np.asarray, state), digest) == []
    changed = dict(state, params=dict(state["params"], b=state["params"]["b"].at[3].add(1.0)))
    assert verify_digest(changed, digest) == ["['params']['b']: bytes differ from the digest"]


def test_a_different_state_is_a_mismatch_not_corruption(tmp_path):
    """Restoring into another model's shapes must not move good checkpoints aside."""
    _save_steps(tmp_path, steps=(1, 2))
    other = _state(0)
    other["params"]["w"] = jnp.zeros((96, 32))
    ckpt = TrainCheckpointer(tmp_path, keep=5)
    with pytest.raises(CheckpointMismatchError, match=r"step 2 at .* holds other arrays than this run's state "
                                                      r"\(\['params'\]\['w'\] is stored as float32\[96, 64\], "
                                                      r"the state has float32\[96, 32\]\)"):
        ckpt.restore_verified(abstract_like(other))
    assert ckpt.all_steps() == [1, 2] and not (tmp_path / "corrupt").exists()
    shutil.rmtree(tmp_path / "2" / "digest")  # without a digest, a failed restore is not moved either
    ckpt = TrainCheckpointer(tmp_path, keep=5)
    with pytest.raises(CheckpointMismatchError, match="step 1 at"):
        ckpt.restore_verified(abstract_like(other))
    assert ckpt.all_steps() == [1, 2] and not (tmp_path / "corrupt").exists()
    ckpt.close()


def test_the_run_config_falls_back_to_an_older_checkpoints_copy(tmp_path, caplog):
    """config.json lost and the newest checkpoint's copy unreadable: an older checkpoint's
    copy (every checkpoint holds the run's one config) is used, not an abort."""
    from trainers.loop import _stored_config

    _save_steps(tmp_path / "checkpoints")
    shutil.rmtree(tmp_path / "checkpoints" / "3" / "config")
    ckpt = TrainCheckpointer(tmp_path / "checkpoints", keep=5)
    with caplog.at_level(logging.WARNING):
        assert _stored_config(tmp_path, ckpt, 3) == {"optimizer": {"lr": 1e-3}}
    assert "step 3" in caplog.text
    for step in (1, 2):
        shutil.rmtree(tmp_path / "checkpoints" / str(step) / "config")
    with pytest.raises(CheckpointCorruptError, match="step 1"):
        _stored_config(tmp_path, ckpt, 3)
    ckpt.close()


@pytest.mark.parametrize("damage", ["unreadable_digest", "empty_step_dir", "no_digest_unreadable"])
def test_every_failed_newer_step_is_moved_so_later_saves_land(tmp_path, damage):
    """orbax saves only steps newer than every step it lists: a failed step left in place
    would make the resumed run's saves of that step and below vanish."""
    _save_steps(tmp_path, steps=(1, 2, 3))
    if damage == "unreadable_digest":
        (tmp_path / "3" / "digest" / "metadata").write_text('{"format": 1, "alg')
    elif damage == "no_digest_unreadable":
        shutil.rmtree(tmp_path / "3" / "digest")
        big = _array_files(tmp_path / "3")[0]
        big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    else:
        (tmp_path / "5").mkdir()  # a partial copy of the run directory
    ckpt = TrainCheckpointer(tmp_path, keep=5)
    abstract = abstract_like(_state(0))
    step, state, _ = ckpt.restore_verified(abstract)
    resumed = 3 if damage == "empty_step_dir" else 2
    assert step == resumed
    _assert_tree_equal(state, _state(resumed))
    assert ckpt.all_steps() == list(range(1, resumed + 1))
    for s in range(resumed + 1, 6):
        ckpt.save(s, _state(s), {"position": s}, {})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 3, 4, 5]
    _assert_tree_equal(ckpt.restore(5, abstract)[0], _state(5))
    with pytest.raises(RuntimeError, match=rf"checkpoint step 4 was not saved: {tmp_path} already holds step 5"):
        ckpt.save(4, _state(4), {"position": 4}, {})
    ckpt.close()
