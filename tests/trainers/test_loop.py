"""The training loop: bit-identical resume, NaN stop with the last good checkpoint intact,
the run directory's files."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic
from trainers.checkpointing import TrainCheckpointer
from trainers.config import ConfigError, ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.recipes import apply_overrides
from trainers.losses import TOKEN_WEIGHTS
from trainers.loop import TrainingDiverged, train


def tiny_experiment(out_dir, **trainer):
    return ExperimentConfig(
        model=jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64),
        data=DataConfig(source=Arithmetic(digits=1), seq_len=24, batch_size=8, pack=True, eval_examples=16),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(out_dir=str(out_dir), progress=False, log_every=1, eval_generate=8,
                              **{"steps": 8, "save_every": 3, "eval_max_new_tokens": 3, **trainer}),
    )


def _params(run_dir):
    ckpt = TrainCheckpointer(run_dir / "checkpoints", keep=5)
    step = ckpt.latest_step()
    ckpt.close()
    model = jaxlm.load_checkpoint(run_dir / "model")
    return step, jax.tree.leaves(jax.tree.map(np.asarray, jaxlm.models.params.flat_params(model)))


def test_resume_is_bit_identical(tmp_path):
    straight = train(tiny_experiment(tmp_path / "a"))
    assert straight.step == 8 and not straight.stopped_early
    # the same run, preempted after 5 steps (last checkpoint: step 3), then re-run unchanged
    first = train(tiny_experiment(tmp_path / "b", stop_after=5))
    assert first.stopped_early and first.step == 5
    resumed = train(tiny_experiment(tmp_path / "b"))
    assert resumed.step == 8
    step_a, params_a = _params(tmp_path / "a")
    step_b, params_b = _params(tmp_path / "b")
    assert step_a == step_b == 8
    for a, b in zip(params_a, params_b):
        np.testing.assert_array_equal(a, b)
    # metrics.jsonl describes one run: each train step logged once, losses identical
    def losses(d):
        recs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]

    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert [s for s, _ in losses(tmp_path / "b")] == list(range(1, 9))
    for name in ("curves.png", "config.json", "tensorboard", "model"):
        assert (tmp_path / "a" / name).exists(), name
    assert straight.final_eval["loss"] > 0 and 0 <= straight.final_eval["accuracy"] <= 1


def test_resume_with_a_different_config_is_refused(tmp_path):
    train(tiny_experiment(tmp_path, stop_after=3, steps=6))
    with pytest.raises(ConfigError, match="different config.*optimizer.lr"):
        train(apply_overrides(tiny_experiment(tmp_path, steps=6), ["optimizer.lr=0.5"]))


def test_a_periodic_eval_lost_to_a_crash_is_run_on_resume(tmp_path, monkeypatch):
    """Checkpoint 3 saved, then the run dies in the evaluation at step 3: the resumed run
    evaluates step 3 before going on, so metrics.jsonl has the evaluations an uninterrupted
    run has."""
    import trainers.sft as sft

    evaluate = sft.SFT.evaluate

    def dies_at_3(self, state, k):
        if k == 3:
            raise RuntimeError("killed during the evaluation")
        return evaluate(self, state, k)

    monkeypatch.setattr(sft.SFT, "evaluate", dies_at_3)
    with pytest.raises(RuntimeError, match="killed during the evaluation"):
        train(tiny_experiment(tmp_path, steps=6, eval_every=3, async_checkpoint=False))
    monkeypatch.setattr(sft.SFT, "evaluate", evaluate)
    assert train(tiny_experiment(tmp_path, steps=6, eval_every=3, async_checkpoint=False)).step == 6
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 3, 6]


def test_an_eval_budget_past_the_model_is_refused_before_any_step(tmp_path):
    """Held-out prompt + trainer.eval_max_new_tokens over model.max_seq_len failed at the first
    evaluation, after training, and the run directory then refused the corrected config."""
    longest = max(len(jaxlm.data.ByteTokenizer().encode(Arithmetic(digits=1).example(i, "eval")["prompt"], add_bos=True))
                  for i in range(8))
    with pytest.raises(ConfigError, match=rf"{longest} tokens \+ trainer.eval_max_new_tokens=60 .* > "
                                          rf"model.max_seq_len=64.*at most {64 - longest}"):
        train(tiny_experiment(tmp_path, eval_max_new_tokens=60, eval_every=0))
    assert not (tmp_path / "config.json").exists() and not (tmp_path / "checkpoints").exists()
    assert train(tiny_experiment(tmp_path, steps=2, eval_max_new_tokens=64 - longest)).step == 2


def test_a_started_run_without_a_checkpoint_is_resumed_only_by_its_config(tmp_path):
    """config.json written, no checkpoint yet: another config is refused (its logs would mix
    with this run's), and the same directory spelled differently is the same run."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(tiny_experiment(tmp_path / "run", steps=6).to_dict()))
    with pytest.raises(ConfigError, match="different config.*optimizer.lr"):
        train(apply_overrides(tiny_experiment(tmp_path / "run", steps=6), ["optimizer.lr=0.5"]))
    train(tiny_experiment(tmp_path / "run", stop_after=3, steps=6))
    resumed = train(tiny_experiment(str(tmp_path / "run") + "/", steps=6))  # trailing slash: same run
    assert resumed.step == 6


def test_missing_input_paths_leave_no_run_directory(tmp_path):
    """A missing init_from or tokenizer was found after the run's lock had created out_dir and
    its parents, which a usage error left behind."""
    from trainers.loop import train

    for field in ("init_from", "tokenizer"):
        out = tmp_path / field / "a" / "b"
        cfg = ExperimentConfig(trainer=TrainerConfig(out_dir=str(out), steps=1, progress=False),
                               **{field: str(tmp_path / "nowhere")})
        with pytest.raises(ConfigError, match=f"{field}=.*nowhere' does not exist"):
            train(cfg)
        assert not (tmp_path / field).exists()


def test_out_dir_must_name_a_directory():
    with pytest.raises(ValueError, match="TrainerConfig.out_dir='' is invalid"):
        TrainerConfig(out_dir="")
    # stop_after <= 0 would end after one step; an empty init_from would start from random weights
    for bad in (0, -5):
        with pytest.raises(ValueError, match=f"TrainerConfig.stop_after={bad} is invalid"):
            TrainerConfig(stop_after=bad)
    with pytest.raises(ValueError, match="ExperimentConfig.init_from='' must be a path"):
        ExperimentConfig(init_from="")
    with pytest.raises(ValueError, match="ExperimentConfig.tokenizer=' '"):
        ExperimentConfig(tokenizer=" ")
    # numpy and grain seed with non-negative integers: a negative seed failed at the first batch
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=f"TrainerConfig.seed={bad!r} is invalid: must be an int >= 0"):
            TrainerConfig(seed=bad)
        with pytest.raises(ValueError, match=f"DataConfig.shuffle_seed={bad!r} is invalid: must be an int >= 0"):
            DataConfig(shuffle_seed=bad)
    # fields a Python recipe sets directly (tyro checks only command-line overrides)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match=rf"OptimizerConfig.warmup_steps={bad!r} must be an int >= 0"):
            OptimizerConfig(warmup_steps=bad)
        with pytest.raises(ValueError, match=rf"TrainerConfig.eval_every={bad!r} must be an int >= 0"):
            TrainerConfig(eval_every=bad)
    with pytest.raises(ValueError, match="OptimizerConfig.schedule='Constant' is invalid"):  # ran cosine
        OptimizerConfig(schedule="Constant")
    for bad in (True, "1.0"):  # True clipped at 1.0; a string failed in a bare comparison
        with pytest.raises(ValueError, match=rf"OptimizerConfig.clip_norm={bad!r} must be > 0 or None"):
            OptimizerConfig(clip_norm=bad)
        with pytest.raises(ValueError, match=rf"algorithm.sem_threshold={bad!r} is invalid"):
            SFTConfig(sem_threshold=bad)
    from trainers.config import DiffusionConfig

    with pytest.raises(ValueError, match="algorithm.objective='pretraining' is invalid"):  # ran the SFT rule
        DiffusionConfig(objective="pretraining")


class _PoisonAt:
    """Wraps the data iterator: batch number `k` gets a marker token that the test's
    token-weight function turns into NaN weights."""

    def __init__(self, it, k):
        self.it, self.k, self.n = it, k, 0

    def __next__(self):
        batch = dict(next(self.it))
        self.n += 1
        if self.n == self.k:
            batch["tokens"] = batch["tokens"].copy()
            batch["tokens"][0, 0] = 258
        return batch

    def get_state(self):
        return self.it.get_state()


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path):
    if "nan_on_marker" not in TOKEN_WEIGHTS:
        TOKEN_WEIGHTS.register("nan_on_marker")(
            lambda batch, logits: jnp.where(jnp.any(batch["tokens"] == 258), jnp.nan, 1.0)
            * jnp.ones(batch["tokens"].shape)
        )
    cfg = apply_overrides(tiny_experiment(tmp_path), ["algorithm.token_weights=nan_on_marker"])
    with pytest.raises(TrainingDiverged, match=r"non-finite loss or gradient at step 5.*Last good checkpoint: step 3"):
        train(cfg, data_iterator_wrapper=lambda it: _PoisonAt(it, 5))
    ckpt = TrainCheckpointer(tmp_path / "checkpoints")
    assert ckpt.all_steps() == [3]
    ckpt.close()
    # the kept checkpoint is complete and resumable: a clean run picks up from step 3
    resumed = train(cfg)
    assert resumed.step == 8


def test_init_from_loads_base_weights_into_a_variant(tmp_path):
    """A meta_swiglu model started from a plain checkpoint equals it (beta = 0)."""
    from trainers.loop import initial_model

    base = jaxlm.build_model(jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64), seed=3)
    jaxlm.save_checkpoint(base, tmp_path / "base")
    cfg = tiny_experiment(tmp_path / "run")
    variant = initial_model(apply_overrides(cfg, ["model.mlp=meta_swiglu", f"init_from={tmp_path / 'base'}"]))
    tokens = jnp.asarray([[1, 20, 30, 40]])
    np.testing.assert_array_equal(variant(tokens).logits, base(tokens).logits)
    with pytest.raises(ConfigError, match="does not fit model"):
        initial_model(apply_overrides(cfg, ["model.d_model=64", f"init_from={tmp_path / 'base'}"]))
    # a layer the checkpoint lacks is no variant parameter: refused, not started at random
    n = base.config.n_layers
    with pytest.raises(ConfigError, match=rf"model has layers the checkpoint lacks \(layers\.{n}\.\*\)"):
        initial_model(apply_overrides(cfg, [f"model.n_layers={n + 1}", f"init_from={tmp_path / 'base'}"]))
    # the tied checkpoint's output layer is its embedding: an untied model starts from that copy
    tied = jaxlm.build_model(dataclasses.replace(base.config, tie_embeddings=True), seed=4)
    jaxlm.save_checkpoint(tied, tmp_path / "tied")
    untied = initial_model(apply_overrides(cfg, ["model.tie_embeddings=false", f"init_from={tmp_path / 'tied'}"]))
    assert not untied.config.tie_embeddings
    np.testing.assert_allclose(untied(tokens).logits, tied(tokens).logits, rtol=1e-6, atol=1e-6)


def test_init_from_a_checkpoint_with_another_tokenizer_is_refused(tmp_path):
    """Its embedding rows belong to its tokenizer's ids: training it under another tokenizer of
    a fitting size ran silently on meaningless ids (and saved the other tokenizer with it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxlm.data.tokenizers import load_tokenizer

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "1", "+", "2", "="])},
                                       unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "words").mkdir()
    words.save(str(tmp_path / "words" / "tokenizer.json"))
    base = jaxlm.build_model(jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64),
                             seed=3, tokenizer=load_tokenizer(tmp_path / "words"))
    jaxlm.save_checkpoint(base, tmp_path / "base")
    cfg = dataclasses.replace(tiny_experiment(tmp_path / "run"), init_from=str(tmp_path / "base"))
    with pytest.raises(ConfigError, match=r"init_from=.*base.*uses a different tokenizer than this run's"):
        train(cfg)  # tokenizer="byte": 259 ids fit the model's vocabulary
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_torn_config_json_falls_back_to_the_checkpoints_copy(tmp_path, caplog):
    first = train(tiny_experiment(tmp_path, stop_after=3, steps=6))
    assert first.stopped_early
    stored = tmp_path / "config.json"
    stored.write_text(stored.read_text()[: 40])  # a kill mid-write of an older, non-atomic writer
    with caplog.at_level("WARNING"):
        resumed = train(tiny_experiment(tmp_path, steps=6))
    assert resumed.step == 6 and not resumed.stopped_early
    assert any(str(stored) in r.getMessage() and "checkpoint step 3" in r.getMessage() for r in caplog.records)
    assert json.loads(stored.read_text())["trainer"]["steps"] == 6  # rewritten whole
    stored.write_text("{")
    with pytest.raises(ConfigError, match="different config.*optimizer.lr"):
        train(apply_overrides(tiny_experiment(tmp_path, steps=6), ["optimizer.lr=0.5"]))


def test_rerunning_a_finished_run_changes_nothing(tmp_path):
    done = train(tiny_experiment(tmp_path, steps=4, save_every=2))
    files = {p: p.read_bytes() for p in [tmp_path / "metrics.jsonl", tmp_path / "config.json"]}
    model_files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "model").rglob("*"))
    again = train(tiny_experiment(tmp_path, steps=4, save_every=2))
    assert again.step == 4 and again.final_eval == {k: v for k, v in done.final_eval.items()}
    assert {p: p.read_bytes() for p in files} == files
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "model").rglob("*")) == model_files


def test_hooks_see_every_step_and_can_stop_the_run(tmp_path):
    seen = []

    def hook(end):
        seen.append((end.step, float(end.metrics["loss"])))
        return end.step == 3

    result = train(tiny_experiment(tmp_path, steps=8), hooks=[hook])
    assert result.stopped_early and result.step == 3
    assert [s for s, _ in seen] == [1, 2, 3] and all(np.isfinite(l) for _, l in seen)


def test_a_registered_algorithm_plugs_into_the_harness(tmp_path):
    """The harness runs any algorithm registered by name: here one whose batch is the step
    index and whose step adds it to a counter in the parameters' place, checkpointed and
    resumed like SFT (its data state included)."""
    import dataclasses as dc

    from trainers.algorithm import ALGORITHMS
    from trainers.step import init_state

    @dc.dataclass(frozen=True)
    class CountConfig:
        name: str = "count_for_test"

    class Count:
        unit = "step"

        def __init__(self, setup):
            self.setup, self.seen = setup, []

        def init_state(self):
            import optax

            return init_state({"total": jnp.zeros(())}, optax.identity(), 0)

        def batch(self, state, k):
            return k, {"k": float(k)}

        def step(self, state, k):
            self.seen.append(k)
            return state.replace(params={"total": state.params["total"] + k}, step=state.step + 1), {
                "loss": float(k), "grad_norm": 0.0, "finite": True}

        def tokens(self, batch):
            return 1.0

        def evaluate(self, state, k):
            return {"total": float(state.params["total"])}, []

        def data_state(self):
            return {"seen": list(self.seen)}

        def load_data_state(self, d):
            self.seen = list(d["seen"])

        def final_model(self, state):
            return self.setup.model

    if "count_for_test" not in ALGORITHMS:
        ALGORITHMS.register("count_for_test")(Count)
    cfg = dataclasses.replace(tiny_experiment(tmp_path, steps=6, save_every=2, stop_after=3),
                              algorithm=CountConfig())
    first = train(cfg)
    assert first.stopped_early and first.step == 3
    done = train(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, stop_after=None)))
    assert done.step == 6 and done.final_eval["total"] == sum(range(6))  # resumed at step 2: 2 + 3 + 4 + 5 after 0 + 1
    assert (tmp_path / "model").is_dir()
    with pytest.raises(ConfigError, match="algorithm.name='nope' is not a registered training algorithm"):
        train(dataclasses.replace(cfg, algorithm=CountConfig(name="nope")))
