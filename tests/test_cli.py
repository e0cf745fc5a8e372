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


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_train_config_help_lists_every_key_with_type_value_and_description(capsys):
    import dataclasses

    from trainers.config_help import config_keys
    from trainers.recipes import load_config

    text = _help(["train", "quickstart", "--help"], capsys)
    cfg = load_config("quickstart")
    keys = config_keys(cfg)
    assert len(keys) > 80
    for key, tp, value, doc in keys:
        assert f"  {key}: {tp} = {value}" in text, key
        assert doc, f"{key} has no description"
    assert "trainer.steps: int = 1000" in text and "optimizer.lr: float = 0.003" in text
    assert "`" not in text
    # a section's kind is listed but is no KEY=VALUE key (setting it said "unknown key algorithm")
    kinds = [k for k, *_ in keys if k in ("algorithm", "data.source")]
    assert sorted(kinds) == ["algorithm", "data.source"]
    for key, _, _, doc in keys:
        if key in kinds:
            assert "not by KEY=VALUE" in doc, key
    # overrides before --help show in the values
    assert "trainer.steps: int = 7" in _help(["train", "quickstart", "trainer.steps=7", "--help"], capsys)
    assert dataclasses.is_dataclass(cfg)


def _flags(cls, prefix=""):
    """``(flag, description)`` of every field of a CLI dataclass and of the dataclasses it
    nests (their fields are flags too), as `trainers.config_help` reads the descriptions."""
    import dataclasses
    import typing

    from trainers.config_help import field_descriptions

    docs = field_descriptions(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        tp = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is typing.Annotated else hints[f.name]
        kinds = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        yield prefix + f.name, docs.get(f.name, "")
        for kind in kinds:
            yield from _flags(kind, f"{prefix}{f.name}.")


@pytest.mark.parametrize("verb", ["quickstart", "train", "eval", "generate", "convert", "quantize", "compress", "edit",
                                  "serve-stream", "logprobs", "judge"])
def test_verb_help_names_real_arguments_and_describes_every_flag(verb, capsys):
    from trainers.cli import VERBS

    text = _help([verb, "--help"], capsys)
    assert "`" not in text and "STR [STR" not in text and "PATH PATH" not in text
    undescribed = [flag for flag, doc in _flags(VERBS[verb][0]) if len(doc) < 8]
    assert not undescribed, f"jaxlm {verb}: flags without a description: {undescribed}"


def test_eval_reports_pass_at_k(tmp_path, capsys):
    """`jaxlm eval --pass-at` prints the library's pass@k for the same samples."""
    from jaxlm.data.tasks import Arithmetic
    from jaxlm.eval import heldout_pass_at_k

    checkpoint = tmp_path / "m"
    jaxlm.save_checkpoint(jaxlm.build_model(jaxlm.ModelConfig.tiny(), tokenizer=jaxlm.ByteTokenizer()), checkpoint)
    main(["eval", "--model", str(checkpoint), "--n", "3", "--max-new-tokens", "3", "--pass-at", "4", "1",
          "--temperature", "2.0"])
    out = capsys.readouterr().out.splitlines()[-1]
    want = heldout_pass_at_k(jaxlm.load_model(checkpoint), Arithmetic(), 3, ks=(1, 4), temperature=2.0,
                             max_new_tokens=3, batch_size=64)
    assert out == (f"arithmetic: pass@1 {want.pass_at_k[1]:.1%}, pass@4 {want.pass_at_k[4]:.1%} "
                   "(4 samples per problem at temperature 2)")


def test_generate_chat_renders_the_prompt_as_a_user_turn(capsys):
    tok = jaxlm.ByteTokenizer()
    main(["generate", "--prompt", "hi", "--chat", "--max-new-tokens", "2", "--temperature", "0"])
    chat = capsys.readouterr().out
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5), tokenizer=tok)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    expected = jaxlm.generate(model, [ids], max_new_tokens=2, temperature=0).texts[0]
    assert f"'hi' -> {expected!r}" in chat


def test_generate_with_beams_prints_each_hypothesis(capsys):
    main(["generate", "--prompt", "ab", "--num-beams", "3", "--num-return-sequences", "2",
          "--max-new-tokens", "3", "--length-penalty", "0.5"])
    out = capsys.readouterr().out.splitlines()
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5), tokenizer=jaxlm.ByteTokenizer())
    expected = jaxlm.generate(model, ["ab"], max_new_tokens=3, num_beams=3, num_return_sequences=2,
                              length_penalty=0.5)
    assert out == [f"'ab' -> {t!r} (beam score {float(s):.3f})" for t, s in zip(expected.texts, expected.beam_scores)]


def test_generate_on_a_masked_diffusion_checkpoint(tmp_path, capsys):
    """`jaxlm generate` on a diffusion checkpoint decodes with `diffusion_generate`
    (gen_length = --max-new-tokens); flags of the other kind of decoding are refused."""
    config = jaxlm.ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=259, init_std=0.3)
    model = jaxlm.build_model(config, seed=1, tokenizer=jaxlm.ByteTokenizer())
    jaxlm.save_checkpoint(model, tmp_path / "dllm")
    main(["generate", "--model", str(tmp_path / "dllm"), "--prompt", "12+34=", "7+8=", "--max-new-tokens", "8",
          "--steps", "4", "--block-length", "4", "--temperature", "0"])
    out = capsys.readouterr()
    want = jaxlm.diffusion_generate(model, ["12+34=", "7+8="], gen_length=8, steps=4, block_length=4)
    assert out.out.splitlines() == [f"{p!r} -> {t!r}" for p, t in zip(["12+34=", "7+8="], want.texts)]
    assert "4 denoising steps" in out.err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path / "dllm"), "--prompt", "x", "--num-beams", "2"])
    assert "--num-beams apply to left-to-right decoding" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--steps", "4"])  # the embedded default is causal
    assert "--steps apply to masked diffusion models" in capsys.readouterr().err
    # flags that were silently dropped or rewritten: --steps with --threshold, --steps 0 (read as
    # the default), --length-penalty without beams
    dllm = ["generate", "--model", str(tmp_path / "dllm"), "--prompt", "x", "--max-new-tokens", "8"]
    for extra, message in ((["--threshold", "0.5", "--steps", "4"], "--steps 4 is not used with --threshold"),
                           (["--steps", "0"], "steps=0 is invalid"),
                           (["--length-penalty", "7"], "--length-penalty apply to left-to-right decoding")):
        with pytest.raises(SystemExit):
            main(dllm + extra)
        assert message in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--length-penalty", "7"])
    assert "--length-penalty 7.0 ranks beam-search hypotheses" in capsys.readouterr().err


def test_generate_with_edit_rounds_on_an_edit_checkpoint(tmp_path, capsys):
    config = jaxlm.ModelConfig.tiny(vocab_size=261, mode="diffusion", mask_token_id=259, next_token_head=True,
                                    delete_token_id=260, init_std=0.3)
    model = jaxlm.build_model(config, seed=1, tokenizer=jaxlm.ByteTokenizer())
    jaxlm.save_checkpoint(model, tmp_path / "medlm")
    main(["generate", "--model", str(tmp_path / "medlm"), "--prompt", "12+34=", "--max-new-tokens", "8",
          "--steps", "2", "--edit-rounds", "2", "--temperature", "0"])
    out = capsys.readouterr()
    want = jaxlm.diffusion_generate(model, ["12+34="], gen_length=8, steps=2, edit_rounds=2, banned_tokens=(260,))
    assert out.out.splitlines() == [f"'12+34=' -> {want.texts[0]!r}"]
    assert f"+ {want.edit_rounds} edit rounds" in out.err
    main(["generate", "--model", str(tmp_path / "medlm"), "--prompt", "12+34=", "--max-new-tokens", "8",
          "--steps", "2", "--edit-rounds", "2", "--edits-per-round", "1", "--temperature", "0"])
    want = jaxlm.diffusion_generate(model, ["12+34="], gen_length=8, steps=2, edit_rounds=2, edits_per_round=1,
                                    banned_tokens=(260,))
    assert capsys.readouterr().out.splitlines() == [f"'12+34=' -> {want.texts[0]!r}"]
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path / "medlm"), "--prompt", "x", "--edits-per-round", "1"])
    assert "--edits-per-round limits the edits of each edit round" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--edit-rounds", "2"])  # the embedded default is causal
    assert "--edit-rounds apply to masked diffusion models" in capsys.readouterr().err


def test_generate_under_a_regex_or_a_json_schema(tmp_path, capsys):
    """The embedded default's random weights write noise; constrained, every completion is
    in the grammar's language."""
    import ast
    import json
    import re

    main(["generate", "--prompt", "a", "b", "--max-new-tokens", "8", "--regex", "(yes|no)!"])
    out = capsys.readouterr().out
    assert len(re.findall(r"-> '(yes|no)!'", out)) == 2, out
    schema = {"enum": ["red", 7, None, [1, "two"]]}  # a literal each: no whitespace for the random model to loop on
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    main(["generate", "--prompt", "x", "--max-new-tokens", "40", "--temperature", "0",
          "--json-schema", str(tmp_path / "schema.json")])
    text = ast.literal_eval(capsys.readouterr().out.split(" -> ", 1)[1].strip())  # the completion's repr
    value = json.loads(text)
    assert value in schema["enum"], text
    for argv, needle in ((["--regex", "a", "--json-schema", str(tmp_path / "schema.json")], "exclusive"),
                         (["--regex", "(a"], "missing ')'"),
                         (["--json-schema", str(tmp_path / "none.json")], "none.json")):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompt", "x", "--max-new-tokens", "4", *argv])
        assert e.value.code == 2
        assert needle in capsys.readouterr().err
