"""Fixtures shared by the distillation tests."""

import pytest

import jaxlm


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A saved random teacher (2 layers of width 48, byte tokenizer) larger than the students."""
    d = tmp_path_factory.mktemp("teacher")
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(d_model=48, n_heads=2, n_kv_heads=1, ffn_dim=96,
                                                     max_seq_len=64), seed=3, tokenizer=jaxlm.ByteTokenizer())
    jaxlm.save_checkpoint(model, d / "model")
    return d / "model"
