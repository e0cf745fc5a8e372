"""`jaxlm quickstart --steps N` (the README's main job, shortened) and `jaxlm train` / `eval`
through the command line."""

import json

from trainers.cli import main


def test_quickstart_small_variant(tmp_path, capsys):
    out = tmp_path / "qs"
    main(["quickstart", "--steps", "12", "--rl-steps", "1", "--out", str(out), "--no-progress",
          "--overrides", "trainer.eval_generate=16", "data.batch_size=16",
          "--rl-overrides", "trainer.eval_generate=8", "data.batch_size=2"])
    printed = capsys.readouterr().out
    assert "Summary" in printed and "held-out exact-match accuracy, SFT" in printed
    assert "chance accuracy" in printed and "Sampled answers" in printed
    assert "GRPO stage" in printed and "held-out exact-match accuracy, GRPO" in printed
    assert "before and after GRPO" in printed  # the same problems' answers, SFT next to GRPO
    assert "NVFP4 W4A4 wush" in printed
    for name in ("model", "metrics.jsonl", "curves.png", "checkpoints", "tensorboard", "config.json",
                 "grpo/model", "grpo/metrics.jsonl", "model_w4a4"):
        assert (out / name).exists(), name
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "eval" and records[-1]["step"] == 12
    # the trained model is usable by the other verbs
    main(["eval", "--model", str(out / "model"), "--n", "8", "--max-new-tokens", "4"])
    printed = capsys.readouterr()
    assert "exact-match accuracy" in printed.out
    assert "eval: 100%" in printed.err and "8/8" in printed.err  # the progress bar
    main(["generate", "--model", str(out / "model"), "--prompt", "1+1=", "--max-new-tokens", "3"])
    assert "'1+1=' ->" in capsys.readouterr().out


def test_train_verb_resumes(tmp_path, capsys):
    args = ["train", "quickstart", f"trainer.out_dir={tmp_path}", "trainer.steps=4", "trainer.save_every=2",
            "trainer.progress=false", "trainer.eval_generate=0", "data.batch_size=8",
            "model.n_layers=1", "model.d_model=32", "model.ffn_dim=64"]
    main(args + ["trainer.stop_after=3"])
    main(args)
    assert "finished at step 4" in capsys.readouterr().out


def test_quantization_stage_without_generation_measures_no_accuracy(tmp_path):
    """``trainer.eval_generate=0`` ("loss only") failed after training: the quantization stage
    asked for the accuracy of no held-out problems. It saves the W4A4 model and measures none."""
    import jaxlm
    from rich.console import Console

    from trainers.quickstart import _quantization_stage
    from trainers.recipes import load_config

    cfg = load_config("quickstart", ["trainer.eval_generate=0"])
    jaxlm.save_checkpoint(jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=0, tokenizer=jaxlm.ByteTokenizer()),
                          tmp_path / "model")
    console = Console(record=True)
    assert _quantization_stage(cfg, tmp_path / "model", tmp_path, console) == {}
    assert (tmp_path / "model_w4a4").is_dir() and "accuracy not measured" in console.export_text()
