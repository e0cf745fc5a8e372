"""MemoPilot's frozen LM player (card B.3: the paper's player is a frozen LLM): SFT'd to play
the counter of the move the memory names (else its dice move), it agrees with the scripted
rule on held-out memories, plays the same episodes, loads from a checkpoint in the collector,
and (slow) the trained memory writer raises *its* win rate over no memory."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from trainers.loop import make_tokenizer
from trainers.rl.collectors import COLLECTORS
from trainers.rl.environments import MOVES, RPSConfig
from trainers.rl.memopilot import (
    counter_player, format_warm_start, lm_player, play_rps, player_warm_start, random_letter_writer, random_memory,
    scripted_player, win_rates, lm_writer,
)

PLAYER_CFG = jaxlm.ModelConfig.tiny(max_seq_len=32)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer("byte")


@pytest.fixture(scope="module")
def player_model(tok):
    return player_warm_start(PLAYER_CFG, tok, steps=400, seed=0)


@pytest.fixture(scope="module")
def player(player_model, tok):
    graphdef, params = nnx.split(player_model)
    return lm_player(graphdef, params, tok)


def test_lm_player_follows_the_rule_on_held_out_memories(player):
    rng = np.random.default_rng(2024)  # not the SFT data's stream
    memories = [random_memory(rng) for _ in range(1000)]
    seeds = rng.integers(0, 2**31, len(memories)).tolist()
    for t in (0, 7, 40):  # round 40 is past the rounds it was trained on (< 64 all the same)
        got = player(memories, seeds, t)
        want = scripted_player(memories, seeds, t)
        agree = np.mean([g == w for g, w in zip(got, want)])
        assert agree >= 0.99, (t, agree)
    # both branches of the rule: a named move is countered, no move -> the dice move
    named = player(list(MOVES) * 5, list(range(15)), 3)
    assert named == [counter_player(m, 0, 3) for m in MOVES * 5]
    empty = player([""] * 30, list(range(30)), 3)
    assert empty == [counter_player("", s, 3) for s in range(30)] and set(empty) == set(MOVES)


def test_lm_player_plays_the_scripted_players_episodes(player, tok):
    cfg = RPSConfig(opponents=("constant", "cycle", "copy_last"), rounds=6, first_to=4)
    specs = [(o, 500 + i) for i, o in enumerate(cfg.opponents * 4)]
    for with_memory in (False, True):  # no memory, then random one-letter memories (same stream twice)
        runs = [play_rps(cfg, specs, tokenizer=tok, num_generations=2, player=p,
                         writer=random_letter_writer(3, tok) if with_memory else None)
                for p in (scripted_player, player)]
        np.testing.assert_array_equal(runs[0].outcomes, runs[1].outcomes)
        assert runs[0].memories == runs[1].memories


def test_player_config_validation_names_the_field():
    with pytest.raises(ValueError, match="RPSConfig.player='llm' is invalid"):
        RPSConfig(player="llm")
    with pytest.raises(ValueError, match="RPSConfig.player_model is required"):
        RPSConfig(player="lm")
    from trainers.config import ConfigError
    from trainers.recipes import load_config

    over = ["algorithm.environment.player=lm", "algorithm.environment.player_model=runs/x/player"]
    env = load_config("memopilot_rps", over).algorithm.environment
    assert (env.player, env.player_model) == ("lm", "runs/x/player")
    with pytest.raises(ConfigError, match="player_model is required"):
        load_config("memopilot_rps", over[:1])


def test_collector_loads_the_frozen_player_checkpoint(player_model, tok, tmp_path):
    from test_multiturn import experiment

    jaxlm.save_checkpoint(player_model, str(tmp_path / "player"))
    cfg = experiment(player="lm", player_model=str(tmp_path / "player"))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=2),
                              algorithm=dataclasses.replace(cfg.algorithm, num_generations=2))
    writer = jaxlm.build_model(cfg.model, seed=0)
    graphdef, params = nnx.split(writer)
    collector = COLLECTORS["rps_memory"](cfg, graphdef, tok)
    exp = collector(params, 0, jax.random.key(0))
    assert np.isfinite(exp.rewards).all() and 0 <= exp.metrics["win_rate"] <= 1
    # the loaded player is the saved one: same moves as the in-memory model
    mem = ["R", "", "xS", "P?"] * 4
    g, p = nnx.split(player_model)
    assert collector.player(mem, list(range(16)), 2) == lm_player(g, p, tok)(mem, list(range(16)), 2)


@pytest.mark.slow
def test_trained_writer_raises_the_lm_players_win_rate(player_model, tok, tmp_path):
    """The claim in miniature with the frozen LM player: after GRPO the player wins more often
    with the trained writer's memory than with none (1/3 by symmetry) or the warm start's."""
    from trainers.rl.loop import GRPOTrainer
    from test_multiturn import EVAL_SEEDS, ITERATIONS, MEMORY_TOKENS, POOL, experiment

    t0 = time.time()
    jaxlm.save_checkpoint(player_model, str(tmp_path / "player"))
    cfg = experiment(player="lm", player_model=str(tmp_path / "player"))
    env = cfg.algorithm.environment
    model = format_warm_start(jaxlm.build_model(cfg.model, seed=1), env, tok, width=cfg.data.seq_len, seed=1)
    trainer = GRPOTrainer(cfg, model, tok)
    state = trainer.init_state()
    initial = jax.tree.map(jnp.copy, state.params)
    for k in range(ITERATIONS):
        state, metrics, _ = trainer.iteration(state, k)
    player = trainer.collector.player
    writer = lambda params: lm_writer(trainer.graphdef, params, tok, width=cfg.data.seq_len - MEMORY_TOKENS,
                                      max_new_tokens=MEMORY_TOKENS)
    evaluate = lambda w: win_rates(env, POOL, EVAL_SEEDS, tokenizer=tok, writer=w, rng=jax.random.key(123),
                                   player=player)
    res = {"no_memory": evaluate(None), "untrained": evaluate(writer(initial)), "trained": evaluate(writer(state.params))}
    print(f"\nMemoPilot RPS with the frozen LM player ({ITERATIONS} iterations, {time.time() - t0:.0f} s):")
    for name, r in res.items():
        print(f"  {name:10s} " + "  ".join(f"{k}={v:.3f}" for k, v in r.items()))
    assert abs(res["no_memory"]["all"] - 1 / 3) < 0.08
    assert res["trained"]["all"] > res["no_memory"]["all"] + 0.1
    assert res["trained"]["all"] > res["untrained"]["all"] + 0.1


def test_scripted_player_is_unchanged():
    """The scripted player is the rule the LM player was trained on (and the default)."""
    assert RPSConfig().player == "scripted"
    assert dataclasses.replace(RPSConfig(), player="scripted").player_model is None
    assert scripted_player(["R", "zz"], [1, 2], 0) == [counter_player("R", 1, 0), counter_player("zz", 2, 0)]
