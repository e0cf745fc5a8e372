"""save_checkpoint / save_hf replace a directory atomically: a kill while the new copy
is swapped in (also when the source is the destination, ``convert M M --overwrite``) and
an error while writing leave a complete model; save_hf keeps the old directory's other
files and drops its stale shards."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jaxlm
from jaxlm.checkpoint import load_checkpoint, save_checkpoint
from jaxlm.models.params import flat_params


def _params(model):
    return {k: np.asarray(v) for k, v in flat_params(model).items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_kill_while_converting_a_model_onto_itself_keeps_it(tmp_path):
    """``convert M M --overwrite`` killed at the moment the new copy takes M's name:
    M was deleted first and lost before; now the next load finds it complete."""
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=1, tokenizer=jaxlm.ByteTokenizer())
    path = tmp_path / "M"
    save_checkpoint(model, path)
    child = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        target = Path({str(path)!r})
        real_rename = os.rename
        def rename(src, dst):
            if Path(dst) == target:  # the rename that publishes the new M
                os.kill(os.getpid(), signal.SIGKILL)
            real_rename(src, dst)
        os.rename = rename
        import jaxlm
        model = jaxlm.load_model(target)
        jaxlm.save_checkpoint(model, target, overwrite=True)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    restored = load_checkpoint(path)  # finishes the swap the kill interrupted
    _assert_same(_params(model), _params(restored))
    assert restored.tokenizer is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["M"]


def test_failed_overwrite_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    old = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=1)
    new = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=2)
    save_checkpoint(old, tmp_path / "ckpt")
    import orbax.checkpoint as ocp

    def fail(self, *args, **kwargs):
        raise OSError("disk full")

    # the writer fails once the target directory is prepared (after an existing one was removed, before)
    monkeypatch.setattr(ocp.CompositeCheckpointHandler, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(new, tmp_path / "ckpt", overwrite=True)
    monkeypatch.undo()
    _assert_same(_params(old), _params(load_checkpoint(tmp_path / "ckpt")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    save_checkpoint(new, tmp_path / "ckpt", overwrite=True)
    _assert_same(_params(new), _params(load_checkpoint(tmp_path / "ckpt")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_load_names_leftovers_it_cannot_use(tmp_path):
    (tmp_path / "M.tmp-otherhost-12-0123abcd").mkdir()  # another host's unfinished write
    with pytest.raises(jaxlm.CheckpointError, match=r"M does not exist.*M\.tmp-otherhost-12-0123abcd "
                                                     r"\(incomplete; written by PID 12 on host otherhost"):
        load_checkpoint(tmp_path / "M")


def test_save_hf_replaces_atomically_and_keeps_other_files(tmp_path):
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=1)
    path = tmp_path / "hf"
    jaxlm.save_hf(model, path, max_shard_bytes=20_000)  # several shards + index
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1
    (path / "README.md").write_text("my notes")
    (path / "extras").mkdir()
    (path / "extras" / "a.txt").write_text("kept")
    # the old model's weights in other formats are weights too (they were carried: two models)
    for name in ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.gguf"):
        (path / name).write_bytes(b"old weights")
    (path / "original").mkdir()
    (path / "original" / "consolidated.00.pth").write_bytes(b"old weights")
    other = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=2)
    jaxlm.save_hf(other, path)  # one file now: the old shards and index must go
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (path / "model.safetensors.index.json").exists()
    assert not [p.name for p in path.iterdir() if p.name in ("pytorch_model.bin", "pytorch_model.bin.index.json",
                                                             "model.gguf", "original")]
    assert (path / "README.md").read_text() == "my notes"
    assert (path / "extras" / "a.txt").read_text() == "kept"
    _assert_same(_params(other), _params(jaxlm.load_hf(path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_save_hf_over_a_jaxlm_checkpoint_replaces_it(tmp_path):
    """The orbax checkpoint a HF directory is written over is not carried into it: every loader
    then reads the new model (`load_model` prefers a jaxlm checkpoint when it finds one)."""
    from jaxlm.checkpoint import convert_checkpoint, load_model

    old, new = (jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=s) for s in (1, 2))
    path = tmp_path / "m"
    save_checkpoint(old, path)
    (path / "NOTES.md").write_text("kept")
    jaxlm.save_hf(new, path)
    assert sorted(p.name for p in path.iterdir()) == ["NOTES.md", "config.json", "model.safetensors"]
    _assert_same(_params(new), _params(load_model(path)))
    save_checkpoint(old, tmp_path / "c")  # the in-place conversion writes the same directory
    convert_checkpoint(tmp_path / "c", tmp_path / "c", to="hf", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json", "model.safetensors"]
    _assert_same(_params(old), _params(load_model(tmp_path / "c")))


def test_save_hf_writes_the_new_tokenizer_over_the_old_ones_files(tmp_path):
    """A model with its own tokenizer, saved over a directory with another tokenizer: the reload
    has the new tokenizer's special ids and (no) chat template, as in a fresh directory."""
    from tokenizers import Tokenizer, models

    def word_tokenizer(words, eos, template=None):
        vocab = {w: i for i, w in enumerate(words)}
        return jaxlm.HFTokenizer(Tokenizer(models.WordLevel(vocab, unk_token=words[0])), eos_id=vocab[eos],
                                 chat_template=template)

    path = tmp_path / "hf"
    first = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=1)
    first.tokenizer = word_tokenizer(["<unk>", "<a_eos>", "x"], "<a_eos>", template="{{ messages[0]['content'] }}")
    jaxlm.save_hf(first, path)
    second = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=2)
    second.tokenizer = word_tokenizer(["<unk>", "x", "y", "<b_eos>"], "<b_eos>")
    jaxlm.save_hf(second, path)
    again = jaxlm.load_hf(path).tokenizer
    assert (again.eos_id, again.chat_template, again.special_tokens) == (3, None, {"eos_token": "<b_eos>"})
    assert not (path / "chat_template.jinja").exists()
