"""The ``jaxlm`` command line: generate on the embedded default, HF <-> orbax conversion."""

import numpy as np
import pytest

import jaxlm
from jaxlm.checkpoint import load_checkpoint
from jaxlm.models.params import flat_params
from trainers.cli import main


def test_generate_embedded_default(capsys):
    main(["generate", "--prompt", "12+30=", "Hi", "--max-new-tokens", "4", "--temperature", "0"])
    out = capsys.readouterr()
    assert "'12+30=' ->" in out.out and "'Hi' ->" in out.out
    assert "embedded default" in out.err


def test_convert_round_trip(tmp_path, capsys):
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(), tokenizer=jaxlm.ByteTokenizer())
    jaxlm.save_hf(model, tmp_path / "hf")
    main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--to", "orbax"])
    main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--to", "hf"])
    restored = load_checkpoint(tmp_path / "ckpt")
    assert isinstance(restored.tokenizer, jaxlm.ByteTokenizer)
    again = jaxlm.load_hf(tmp_path / "hf2")
    for k, v in flat_params(model).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flat_params(again)[k]), err_msg=k)
    main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "ab", "--max-new-tokens", "2"])
    assert "'ab' ->" in capsys.readouterr().out


def test_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert e.value.code == 2
    assert "neither a jaxlm checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--max-new-tokens", "many"])  # tyro type-checks the value
