"""The synthetic audio-visual task: the square moves as its direction says and is the one
distinct patch per frame, the tone's frequency (by FFT) is its label's pitch and sits in the
stated frames, and answers follow the ground truth."""

import numpy as np
import pytest

from jaxlm.data.audiovisual import DIRECTIONS, AVTaskConfig, av_example, shape_texture


@pytest.mark.parametrize("index", range(20))
def test_clip_ground_truth(index):
    cfg = AVTaskConfig(questions=("move:", "look:", "tone:"))
    ex = av_example(cfg, index, seed=3)
    assert ex["video"].shape == (cfg.frames, cfg.grid, cfg.grid, cfg.patch_dim)
    assert ex["audio"].shape == (cfg.audio_frames, cfg.window)
    dr, dc = DIRECTIONS[ex["direction"]]
    for f, (r, c) in enumerate(ex["cells"]):
        assert (r, c) == (ex["cells"][0][0] + f * dr, ex["cells"][0][1] + f * dc)
        bright = ex["video"][f].mean(-1)
        assert np.unravel_index(np.argmax(bright), bright.shape) == (r, c)
        np.testing.assert_allclose(ex["video"][f, r, c], shape_texture(cfg, ex["shape"]), atol=0.3)
    energy = (ex["audio"] ** 2).mean(1)
    tone = np.flatnonzero(energy > 0.1)
    assert tone.tolist() == list(range(ex["tone_at"], ex["tone_at"] + cfg.tone_frames))
    # the tone's frequency over the tone frames, by FFT, is the label's pitch (whole cycles per frame here)
    signal = ex["audio"][tone].reshape(-1)
    cycles = np.argmax(np.abs(np.fft.rfft(signal))[1:]) + 1
    assert cycles / len(tone) == pytest.approx(cfg.pitch(ex["label"]), abs=0.5)
    expected = {"move:": ex["direction"], "look:": "WXYZ"[ex["shape"]], "tone:": chr(65 + ex["label"])}
    assert ex["answer"] == expected[ex["question"]]


def test_textures_and_pitches_are_distinct():
    cfg = AVTaskConfig()
    textures = [shape_texture(cfg, s) for s in range(cfg.n_shapes)]
    assert len({t.tobytes() for t in textures}) == cfg.n_shapes
    assert len({cfg.pitch(k) for k in range(cfg.n_labels)}) == cfg.n_labels and cfg.pitch(cfg.n_labels - 1) < cfg.window / 2


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="grid"):
        AVTaskConfig(grid=2, frames=4)
    with pytest.raises(ValueError, match="questions"):
        AVTaskConfig(questions=("color:",))
    with pytest.raises(ValueError, match="AVTaskConfig.patch=1 must be >= 2"):
        AVTaskConfig(patch=1)
    with pytest.raises(ValueError, match="AVTaskConfig.frames=1 must be >= 2 to ask 'move:'"):
        AVTaskConfig(frames=1, questions=("move:",))
    AVTaskConfig(frames=1, questions=("look:",))  # no motion asked: one frame is enough
    with pytest.raises(ValueError, match="AVTaskConfig.window=4 must be an int >= 5"):
        AVTaskConfig(window=4)  # every tone label would have pitch 1
    cfg = AVTaskConfig(window=5)
    pitches = [cfg.pitch(k) for k in range(cfg.n_labels)]
    assert len(set(pitches)) == cfg.n_labels and max(pitches) < cfg.window / 2
