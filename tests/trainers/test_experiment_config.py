"""Experiment configs: overrides are parsed and type-checked by tyro; bad keys and values
fail with the field named (and the closest valid keys)."""

import pytest

from jaxlm.data.tasks import Arithmetic, Countdown
from trainers.config import ConfigError, ExperimentConfig
from trainers.recipes import apply_overrides, load_config


def test_overrides_are_typed():
    cfg = load_config("quickstart", ["model.n_layers=4", "optimizer.lr=0.01", "data.pack=false",
                                     "trainer.eval_every=7", "optimizer.clip_norm=None",
                                     "data.source.digits=3"])
    assert cfg.model.n_layers == 4 and isinstance(cfg.model.n_layers, int)
    assert cfg.optimizer.lr == 0.01
    assert cfg.data.pack is False
    assert cfg.trainer.eval_every == 7
    assert cfg.optimizer.clip_norm is None
    assert cfg.data.source == Arithmetic(digits=3, ops=("+",), carry_slip=0.6)  # the quickstart's flawed teacher


def test_tuple_fields_take_comma_or_space_separated_items():
    assert load_config("omni_av", ["algorithm.task.questions=move:,tone:"]).algorithm.task.questions == ("move:", "tone:")
    assert load_config("omni_av", ["algorithm.task.questions=look: tone:"]).algorithm.task.questions == ("look:", "tone:")
    assert load_config("omni_av", ["algorithm.task.questions=tone:"]).algorithm.task.questions == ("tone:",)
    fill = load_config("diffusion_sort", ["algorithm.edit_fill_per_step=2,5"]).algorithm.edit_fill_per_step
    assert fill == (2, 5) and all(isinstance(k, int) for k in fill)
    with pytest.raises(ConfigError, match="questions.*each must be one of"):
        load_config("omni_av", ["algorithm.task.questions=look:,why:"])
    with pytest.raises(ConfigError, match="edit_fill_per_step"):
        load_config("diffusion_sort", ["algorithm.edit_fill_per_step=2,x"])
    with pytest.raises(ConfigError, match="questions.*No closing quotation"):
        load_config("omni_av", ["algorithm.task.questions=look: 'tone:"])
    # a quoted item keeps its commas: one composed condition, not two conditions
    one = load_config("megan", ["data.source.cond_len=16", "data.source.held_out='reverse, add 3'"])
    assert one.data.source.held_out == ("reverse, add 3",)
    two = load_config("megan", ["data.source.cond_len=16", "data.source.held_out='reverse, add 3' 'add 7'"])
    assert two.data.source.held_out == ("reverse, add 3", "add 7")


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"^unknown key model.n_layer\nclosest keys: model.n_layers"):
        load_config("quickstart", ["model.n_layer=4"])


def test_override_values_keep_their_text_unless_the_field_is_a_bool():
    """`true` is capitalised only for a bool field; a value may start with '-'."""
    cfg = load_config("quickstart", ["trainer.out_dir=-runs/true", "trainer.progress=false", "tokenizer=false"])
    assert (cfg.trainer.out_dir, cfg.trainer.progress, cfg.tokenizer) == ("-runs/true", False, "false")


def test_badly_typed_value_names_the_field():
    with pytest.raises(ConfigError, match=r"^invalid value for trainer.steps: invalid literal for int.*\ntrainer.steps INT: Optimizer steps"):
        load_config("quickstart", ["trainer.steps=many"])


def test_config_validation_runs_after_overrides():
    with pytest.raises(ConfigError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        load_config("quickstart", ["model.n_kv_heads=3"])
    with pytest.raises(ConfigError, match="data.batch_size=64 is not divisible by trainer.grad_accum=5"):
        load_config("quickstart", ["trainer.grad_accum=5"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config("quickstart", ["trainer.steps"])


def test_unknown_config_and_paths(tmp_path):
    with pytest.raises(ConfigError, match="no config named 'nope'; known: .*quickstart"):
        load_config("nope")
    path = tmp_path / "mine.py"
    path.write_text(
        "from trainers.config import ExperimentConfig\n"
        "from jaxlm.data.pipeline import DataConfig\n"
        "from jaxlm.data.tasks import Countdown\n"
        "def get_config():\n    return ExperimentConfig(data=DataConfig(source=Countdown(n_numbers=4)))\n"
    )
    cfg = load_config(str(path), ["data.source.max_number=9"])
    assert cfg.data.source == Countdown(n_numbers=4, max_number=9)
    (tmp_path / "bad.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="has no get_config"):
        load_config(str(tmp_path / "bad.py"))


def test_unknown_token_weights():
    with pytest.raises(ValueError, match="algorithm.token_weights='pear2' is invalid"):
        apply_overrides(ExperimentConfig(), ["algorithm.token_weights=pear2"])


def test_optional_sections_switch_on_and_off_from_the_command_line():
    """``X | None`` sections: ``=None`` turns one off; setting a field inside a None section
    turns it on with its defaults; a bad value inside still names the field."""
    from trainers.config import PrefixConfig

    prefixed = load_config("prefix_rl")
    assert prefixed.algorithm.prefix is not None
    off = apply_overrides(prefixed, ["algorithm.prefix=None", "trainer.steps=3"])
    assert off.algorithm.prefix is None and off.trainer.steps == 3
    on = apply_overrides(load_config("grpo_arithmetic"), ["algorithm.prefix.problems=32"])
    assert on.algorithm.prefix == PrefixConfig(problems=32)
    with pytest.raises(ConfigError, match="problems"):
        apply_overrides(load_config("grpo_arithmetic"), ["algorithm.prefix.problems=-1"])
    with pytest.raises(ConfigError, match="algorithm.prefix.problems"):
        apply_overrides(load_config("grpo_arithmetic"), ["algorithm.prefix.problemz=32"])
    # a section whose defaults alone do not validate is checked once every override is in
    distill = apply_overrides(load_config("quickstart"), ["algorithm.distill.teacher=/tmp/teacher"])
    assert distill.algorithm.distill.teacher == "/tmp/teacher"
    offline = apply_overrides(load_config("quickstart"), ["algorithm.distill.teacher_logprobs=offline"])
    assert offline.algorithm.distill.teacher is None
    with pytest.raises(ConfigError, match="a teacher checkpoint path is needed"):
        apply_overrides(load_config("quickstart"), ["algorithm.distill.top_k=3"])
    # and a parent's cross-field check sees the final values (camel needs collector=camel)
    camel = apply_overrides(load_config("grpo_arithmetic"), ["algorithm.camel.flip_prob=0.5", "algorithm.collector=camel"])
    assert camel.algorithm.camel.flip_prob == 0.5 and camel.algorithm.collector == "camel"
    with pytest.raises(ConfigError, match="needs collector='camel'"):
        apply_overrides(load_config("grpo_arithmetic"), ["algorithm.camel.flip_prob=0.5"])
    # a field set inside a section that a later override switches off contradicts it (it used
    # to be reported as an unknown key); switched off, then a field set, turns it on again
    with pytest.raises(ConfigError, match=r"algorithm.prefix.problems sets a field of algorithm.prefix, which algorithm.prefix=None"):
        apply_overrides(prefixed, ["algorithm.prefix.problems=32", "algorithm.prefix=None"])
    again = apply_overrides(prefixed, ["algorithm.prefix=None", "algorithm.prefix.problems=32"])
    assert again.algorithm.prefix == PrefixConfig(problems=32)


def test_quiet_trainer_preset_only_trains_and_saves_the_final_model():
    from trainers.config import TrainerConfig

    q = TrainerConfig.quiet(5, "runs/x", seed=2)
    assert q == TrainerConfig(steps=5, out_dir="runs/x", seed=2, progress=False, log_every=1000, eval_every=0,
                              save_every=100_000, eval_generate=0)
    with pytest.raises(ValueError, match="TrainerConfig.steps=0"):
        TrainerConfig.quiet(0)


def test_every_shipped_recipe_loads_and_validates():
    from trainers.recipes import known_recipes
    names = known_recipes()
    assert {"quickstart", "diffusion_sort", "diffusion_sort_either", "medlm_sort_either"} <= set(names)
    for name in names:
        assert isinstance(load_config(name), ExperimentConfig), name
