"""Task-vector arithmetic and (attenuated) extrapolation: exact endpoints, schedules,
the norm-matched random control, and errors."""

import functools

import jax
import numpy as np
import pytest

import jaxlm
from jaxlm.editing import (
    SCHEDULES,
    apply_task_vectors,
    extrapolate,
    interpolate,
    random_direction,
    random_direction_control,
    schedule_weights,
    task_vector,
)
from jaxlm.models.config import ModelConfig
from jaxlm.models.params import flat_params, model_from_flat

CFG = ModelConfig.tiny(n_layers=3)
NON_LAYER = ("embed", "final_norm.scale", "lm_head.kernel")


@functools.cache
def _flat_pair():
    """Base weights and a "tuned" copy with noise on every parameter (norms included)."""
    base = {k: np.asarray(v) for k, v in flat_params(jaxlm.build_model(CFG, seed=0)).items()}
    rng = np.random.default_rng(1)
    tuned = {k: v + np.float32(0.02) * rng.standard_normal(v.shape, dtype=np.float32) for k, v in base.items()}
    return base, tuned


@pytest.fixture(scope="module")
def flats():
    return _flat_pair()


@pytest.fixture(scope="module", params=[False, True], ids=["unrolled", "scanned"])
def models(request):
    base, tuned = _flat_pair()
    cfg = CFG.replace(scan_layers=request.param)
    return model_from_flat(cfg, base), model_from_flat(cfg, tuned)


def _np(params):
    flat = flat_params(params) if isinstance(params, jaxlm.Transformer) else params
    return {k: np.asarray(v) for k, v in flat.items()}


def _assert_equal(a, b):
    a, b = _np(a), _np(b)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_endpoints_are_exact_for_models(models, flats):
    base, tuned = models
    for fn in (interpolate, extrapolate):
        out = fn(base, tuned, 1.0)
        assert isinstance(out, jaxlm.Transformer) and out.config.scan_layers == base.config.scan_layers
        _assert_equal(out, tuned)
        _assert_equal(fn(base, tuned, 0.0), base)
    for schedule in SCHEDULES:  # every alpha_l = 1 at alpha = 1
        _assert_equal(extrapolate(base, tuned, 1.0, schedule=schedule), tuned)
    _assert_equal(random_direction_control(base, tuned, 0.0), base)
    _assert_equal(random_direction_control(base, tuned, 1.0, anchor="tuned"), tuned)
    _assert_equal(base, flats[0])  # inputs unmodified
    _assert_equal(tuned, flats[1])


def test_endpoints_are_exact_for_flat_dicts(flats):
    base, tuned = flats
    before = {k: v.copy() for k, v in base.items()}
    _assert_equal(interpolate(base, tuned, 1.0), tuned)
    _assert_equal(interpolate(base, tuned, 0.0), base)
    _assert_equal(extrapolate(base, tuned, 1.0, schedule="linear_depth"), tuned)
    _assert_equal(base, before)


def test_extrapolation_is_2r_minus_m(models, flats):
    base, tuned = flats
    out = _np(extrapolate(*models, 2.0))
    for k in base:
        np.testing.assert_allclose(out[k], 2 * tuned[k] - base[k], rtol=1e-6, atol=1e-7, err_msg=k)
    mixed = _np(interpolate(models[0], tuned, 0.25))  # a model and a dict mix
    for k in base:
        np.testing.assert_allclose(mixed[k], 0.75 * base[k] + 0.25 * tuned[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("alpha", [10.0, 50.0, -7.0])
def test_far_extrapolation_keeps_the_step_exact(alpha):
    """A small fine-tuning delta (1e-4 relative) pushed far: ``M + a (R - M)`` within an ulp
    or two of a float64 reference (``(1 - a) M + a R`` lost the step to cancellation: 224 ulp
    at a = 50)."""
    rng = np.random.default_rng(0)
    m = (0.02 * rng.standard_normal((64, 64))).astype(np.float32)
    r = (m + np.float32(2e-6) * rng.standard_normal(m.shape)).astype(np.float32)
    got = np.asarray(extrapolate({"w": m}, {"w": r}, alpha)["w"], np.float64)
    m64, r64 = m.astype(np.float64), r.astype(np.float64)
    want = m64 + np.float64(np.float32(alpha)) * (r64 - m64)
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 2


def test_blocks_only_leaves_embeddings_norms_and_head_at_tuned(models, flats):
    base, tuned = flats
    out = _np(extrapolate(*models, 2.0, schedule="blocks_only"))
    for k in base:
        if k.startswith("layers.") and k.endswith(".kernel"):
            np.testing.assert_allclose(out[k], 2 * tuned[k] - base[k], rtol=1e-6, atol=1e-7, err_msg=k)
            assert not np.array_equal(out[k], tuned[k])
        else:
            assert k in NON_LAYER or k.endswith("norm.scale"), k
            np.testing.assert_array_equal(out[k], tuned[k], err_msg=k)


def test_middle_changes_only_the_middle_layer(models, flats):
    base, tuned = flats
    out = _np(extrapolate(*models, 3.0, schedule="middle"))
    for k in base:
        if k.startswith("layers.1."):
            np.testing.assert_allclose(out[k], 3 * tuned[k] - 2 * base[k], rtol=1e-6, atol=1e-6, err_msg=k)
            assert not np.array_equal(out[k], tuned[k]), k
        else:
            np.testing.assert_array_equal(out[k], tuned[k], err_msg=k)


def test_head_only_changes_only_the_output_head(models, flats):
    base, tuned = flats
    out = _np(extrapolate(*models, 1.5, schedule="head_only"))
    for k in base:
        if k == "lm_head.kernel":
            np.testing.assert_allclose(out[k], 1.5 * tuned[k] - 0.5 * base[k], rtol=1e-6, atol=1e-7, err_msg=k)
            assert not np.array_equal(out[k], tuned[k])
        else:
            np.testing.assert_array_equal(out[k], tuned[k], err_msg=k)


def test_a_schedule_that_moves_nothing_is_an_error(flats):
    base, tuned = flats
    tied = {k: v for k, v in base.items() if not k.startswith("lm_head")}
    tied_tuned = {k: tuned[k] for k in tied}
    with pytest.raises(ValueError, match="tied embeddings"):
        extrapolate(tied, tied_tuned, 2.0, schedule="head_only")
    with pytest.raises(ValueError, match="weight 0 to every parameter"):
        random_direction_control(base, tuned, 2.0, schedule={r"^nothing$": 1.0})
    assert set(schedule_weights(tied, "head_only").values()) == {0.0}  # reading the weights is fine


def test_linear_depth_and_custom_schedules(flats):
    base, tuned = flats
    w = schedule_weights(base, "linear_depth")
    assert w["layers.0.mlp.up_proj.kernel"] == 1.0 and w["layers.1.attn_norm.scale"] == 0.5
    assert w["layers.2.attn.q_proj.kernel"] == 0.0 and all(w[k] == 1.0 for k in NON_LAYER)
    out = extrapolate(base, tuned, 3.0, schedule="linear_depth")
    k = "layers.1.attn.o_proj.kernel"  # alpha_l = 1 + 2 * 0.5 = 2
    np.testing.assert_allclose(out[k], 2 * tuned[k] - base[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out["layers.2.mlp.down_proj.kernel"], tuned["layers.2.mlp.down_proj.kernel"])

    w = schedule_weights(base, {r"\.mlp\.": 1.0, r"^layers\.0\.": 0.5})  # first match wins
    assert w["layers.0.mlp.up_proj.kernel"] == 1.0 and w["layers.0.attn.q_proj.kernel"] == 0.5
    assert w["layers.2.attn.q_proj.kernel"] == 0.0 and w["embed"] == 0.0
    w = schedule_weights(base, lambda name, layer, n: 1.0 if layer == n - 1 else 0.0)
    assert {k for k, v in w.items() if v} == {k for k in base if k.startswith("layers.2.")}


def test_add_then_negate_returns_base(models, flats):
    base, tuned = models
    tv = task_vector(base, tuned)
    assert isinstance(tv, jaxlm.Transformer)
    flat_tv = _np(tv)
    for k, v in flat_tv.items():
        np.testing.assert_allclose(v, flats[1][k] - flats[0][k], rtol=1e-6, atol=1e-7, err_msg=k)
    added = apply_task_vectors(base, tv, 1.0)
    back = apply_task_vectors(added, [tv], [-1.0])
    both = apply_task_vectors(flats[0], [flat_tv, flat_tv], [1.0, -1.0])
    for out, ref in ((added, flats[1]), (back, flats[0]), (both, flats[0])):
        out = _np(out)
        for k in ref:
            np.testing.assert_allclose(out[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)


def _cos(a, b):
    return float(np.vdot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_random_control_is_norm_matched_and_not_parallel(models, flats):
    base, tuned = flats
    tau = {k: tuned[k] - base[k] for k in base}
    xi = _np(random_direction(*models, seed=0))
    for k in base:
        np.testing.assert_allclose(np.linalg.norm(xi[k]), np.linalg.norm(tau[k]), rtol=1e-5, err_msg=k)
        assert abs(_cos(xi[k], tau[k])) < 0.9, k
    cat = lambda d: np.concatenate([d[k].ravel() for k in sorted(d)])  # noqa: E731
    assert abs(_cos(cat(xi), cat(tau))) < 0.05

    out = _np(random_direction_control(*models, 2.0, seed=0))
    for k in base:
        np.testing.assert_allclose(out[k], base[k] + 2 * xi[k], rtol=1e-6, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(
            np.linalg.norm(out[k] - base[k]) / 2, np.linalg.norm(tau[k]), rtol=1e-5, err_msg=k
        )
    # keyed by parameter name: the same for stacked and unrolled layers and for dicts
    _assert_equal(random_direction(base, tuned, seed=0), xi)
    other = _np(random_direction(base, tuned, seed=1))
    assert not np.allclose(other["embed"], xi["embed"])

    ctrl = _np(random_direction_control(base, tuned, 3.0, schedule="middle", anchor="tuned"))
    for k in base:
        if k.startswith("layers.1."):
            np.testing.assert_allclose(ctrl[k], tuned[k] + 2 * xi[k], rtol=1e-6, atol=1e-7, err_msg=k)
        else:
            np.testing.assert_array_equal(ctrl[k], tuned[k], err_msg=k)


def test_extrapolated_model_runs(models):
    out = extrapolate(*models, 2.0, schedule="linear_depth")
    tokens = jax.random.randint(jax.random.key(0), (2, 5), 3, CFG.vocab_size)
    logits = np.asarray(out(tokens).logits)
    assert logits.shape == (2, 5, CFG.vocab_size) and np.isfinite(logits).all()


def test_bad_inputs_raise_named_errors(flats):
    base, tuned = flats
    with pytest.raises(ValueError, match=r"unknown schedule 'deep'.*'blocks_only'.*'uniform'"):
        extrapolate(base, tuned, 2.0, schedule="deep")
    with pytest.raises(ValueError, match="key 'mlp_norm'"):
        extrapolate(base, tuned, 2.0, schedule={"embed": 0.5, "mlp_norm": 1.5})
    with pytest.raises(ValueError, match="parameter 'embed'"):
        schedule_weights(base, lambda name, layer, n: -1.0)
    bad = {**tuned, "layers.1.attn.q_proj.kernel": tuned["layers.1.attn.q_proj.kernel"][:, :8]}
    with pytest.raises(ValueError, match=r"parameter 'layers\.1\.attn\.q_proj\.kernel' has shape"):
        extrapolate(base, bad, 2.0)
    missing = {k: v for k, v in tuned.items() if k != "lm_head.kernel"}
    with pytest.raises(ValueError, match="parameter 'lm_head.kernel'"):
        task_vector(base, missing)
    shallow = model_from_flat(CFG.replace(n_layers=2), {k: v for k, v in base.items() if not k.startswith("layers.2.")})
    with pytest.raises(ValueError, match=r"parameter 'layers\.2\."):
        interpolate(base, shallow, 0.5)
    with pytest.raises(ValueError, match=r"vectors\[0\]"):
        apply_task_vectors(base, [bad], [1.0])
    with pytest.raises(ValueError, match="2 coeffs for 1 vectors"):
        apply_task_vectors(base, [tuned], [1.0, 2.0])
    with pytest.raises(ValueError, match="alpha"):
        extrapolate(base, tuned, float("nan"))
    with pytest.raises(ValueError, match="anchor"):
        random_direction_control(base, tuned, 2.0, anchor="middle")
