"""`load_hf` at the level of single tensors: bf16 stays bf16 (bit for bit, never upcast), each
tensor is on the device as soon as it is read, and the flat view is released as the model is
built, so the host holds one copy of the weights (bench/scale_check.py measures it at scale)."""

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # builds the checkpoint
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import jaxlm  # noqa: E402
import jaxlm.models.hf.io as hf_io  # noqa: E402
from hf_reference import build_hf_model  # noqa: E402
from jaxlm.models.hf.families import FAMILIES  # noqa: E402
from jaxlm.models.params import flat_params, model_from_flat, param_shapes  # noqa: E402


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_bf16")
    build_hf_model("qwen3_qknorm_mqa").to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("scan", [False, True])
def test_bf16_checkpoint_loads_bit_exact_without_upcast(bf16_dir, scan):
    stored = load_file(str(bf16_dir / "model.safetensors"))
    model = jaxlm.load_hf(bf16_dir, dtype="bfloat16", scan_layers=scan)
    family = FAMILIES[model.config.family]
    flat = flat_params(model)
    assert {str(v.dtype) for v in flat.values()} == {"bfloat16"}
    for name, value in flat.items():
        hf_name, transpose = family.to_hf(name)
        want = stored[hf_name].T if transpose else stored[hf_name]
        assert want.dtype == jnp.bfloat16, hf_name
        np.testing.assert_array_equal(np.asarray(value).view(np.uint16), want.view(np.uint16), err_msg=name)


def test_tensors_are_placed_as_read_and_released(bf16_dir, monkeypatch):
    seen = {}

    def spy(config, flat, **kw):
        seen["types"] = {type(v) for v in flat.values()}
        model = model_from_flat(config, flat, **kw)
        seen["left"] = len(flat)
        return model

    monkeypatch.setattr(hf_io, "model_from_flat", spy)
    jaxlm.load_hf(bf16_dir, dtype="bfloat16")
    assert seen["types"] == {type(jnp.zeros(1))}  # device arrays, no numpy copies on the host
    assert seen["left"] == 0  # model_from_flat(release=True) dropped every entry


def test_model_from_flat_builds_independent_models():
    """The abstract model is cached per config; every built model still has its own Variables."""
    cfg = jaxlm.ModelConfig.tiny(n_layers=1)
    shapes = param_shapes(cfg)
    zeros = {k: np.zeros(s.shape, np.float32) for k, s in shapes.items()}
    ones = {k: np.ones(s.shape, np.float32) for k, s in shapes.items()}
    a, b = model_from_flat(cfg, zeros), model_from_flat(cfg, ones)
    assert float(jnp.abs(a.embed[...]).max()) == 0.0 and float(b.embed[...].min()) == 1.0
    with pytest.raises(TypeError, match="mutable mapping"):
        model_from_flat(cfg, types.MappingProxyType(zeros), release=True)
