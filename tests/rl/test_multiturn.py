"""Multi-turn GRPO (MemoPilot, card B.3): the turn-level advantage against a numpy reference
(episodes of different lengths), the verl#7244 caution as an exact expectation, the RPS
environment's semantics, the rollout rows (context tokens untrained, turn indices, exact
log-prob recompute), and the paper's claim in miniature: a GRPO-trained memory writer
raises a frozen player's win rate against exploitable opponents above no memory."""

import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.data.pipeline import DataConfig
from jaxlm.models.config import ModelConfig
from trainers.config import ConfigError, ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig
from trainers.recipes import load_config
from trainers.loop import make_tokenizer
from trainers.rl.advantages import ADVANTAGES
from trainers.rl.collectors import COLLECTORS
from trainers.rl.environments import MOVES, OPPONENTS, Environment, RockPaperScissors, RPSConfig, counter, outcome
from trainers.rl.loop import GRPOTrainer
from trainers.rl.memopilot import (
    SEGMENT, counter_player, episode_width, format_warm_start, lm_writer, play_rps, turn_rewards, win_rates,
)

R_, P_, S_ = 0, 1, 2


# ----------------------------------------------------------------------------------------
# The turn-level advantage (context-independent: pool the G rollouts at each turn index)


def np_turn_level(rewards, lengths, *, gamma=None, eps=1e-6, scale=True):
    """Independent reference: loops over groups, turns and rollouts. ``lengths [B, G]``:
    turns each episode reached; later turns are padding."""
    B, G, K = rewards.shape
    r = np.where(np.arange(K)[None, None] < lengths[..., None], rewards, 0.0).astype(np.float64)
    if gamma is not None:
        ret = np.zeros_like(r)
        for b, g in itertools.product(range(B), range(G)):
            for k in range(K):
                ret[b, g, k] = sum(gamma ** (j - k) * r[b, g, j] for j in range(k, lengths[b, g]))
        r = ret
    out = np.zeros((B, G, K))
    for b, k in itertools.product(range(B), range(K)):
        reached = [g for g in range(G) if k < lengths[b, g]]
        if len(reached) < 2:
            continue
        x = np.array([r[b, g, k] for g in reached])
        for g in reached:
            a = r[b, g, k] - x.mean()
            out[b, g, k] = a / (x.std(ddof=1) + eps) if scale else a
    return out


@pytest.mark.parametrize("gamma", [None, 1.0, 0.7])
@pytest.mark.parametrize("scale", [True, False])
def test_turn_level_advantage_matches_numpy_with_variable_lengths(gamma, scale):
    rng = np.random.default_rng(0)
    B, G, K = 4, 6, 5
    rewards = (rng.integers(-1, 2, size=(B, G, K)) + rng.normal(0, 0.1, (B, G, K))).astype(np.float32)
    lengths = rng.integers(1, K + 1, size=(B, G))
    lengths[0] = K  # a group of fixed-length episodes
    lengths[1, :] = 2
    lengths[1, 0] = K  # only one rollout reaches turns 2..K-1: no baseline there
    valid = np.arange(K)[None, None] < lengths[..., None]
    padded = np.where(valid, rewards, 123.0)  # garbage in padded turns must not leak
    got = np.asarray(ADVANTAGES["turn_level"](padded, valid, gamma=gamma, scale=scale))
    want = np_turn_level(rewards, lengths, gamma=gamma, scale=scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[~valid] == 0)
    assert np.all(got[1, 0, 2:] == 0)


def test_turn_level_caution_of_verl_7244_exact_expectation():
    """verl#7244: per-turn-index baselines on per-turn rewards give no credit to a decision
    that buys more turns (its value sits in later turns). Exact expectation over every joint
    outcome of G rollouts of a 2-turn episode: turn 0 continues (prob p) or stops, r_0 = 0,
    a continuing episode gets r_1 = 1. True gradient of J = p in the logit: p (1 - p).
    Returns-to-go on zero-padded rewards with one per-index baseline (``turn_gamma=1``,
    unscaled) give exactly (1 - 1/G) x the true gradient (the usual self-included-mean
    shrinkage); per-turn rewards give 0, and so does summing an episode's per-turn-index
    advantages (a baseline with one term per turn the episode itself chose to take)."""
    G, p = 4, 0.3
    joint = np.array(list(itertools.product([True, False], repeat=G)))  # every outcome: one group each
    prob = np.where(joint, p, 1 - p).prod(1)
    score = np.where(joint, 1 - p, -p)  # d log pi(a) / d logit
    rewards = np.stack([np.zeros(joint.shape), joint.astype(float)], -1).astype(np.float32)
    valid = np.stack([np.ones(joint.shape, bool), joint], -1)
    expected = {}
    for gamma in (None, 1.0):
        adv = np.asarray(ADVANTAGES["turn_level"](rewards, valid, gamma=gamma, scale=False))
        expected[gamma] = float((prob * (adv[:, :, 0] * score).sum(1)).sum() / G)  # per rollout
        if gamma is None:  # the construction the RFC warns about: sum own per-turn advantages
            expected["summed"] = float((prob * (adv.sum(-1) * score).sum(1)).sum() / G)
    true = p * (1 - p)
    assert expected[None] == pytest.approx(0.0, abs=1e-7)
    assert expected["summed"] == pytest.approx(0.0, abs=1e-7)
    assert expected[1.0] == pytest.approx((1 - 1 / G) * true, rel=1e-5)


def test_turn_rewards_brute_force():
    rng = np.random.default_rng(3)
    R, N = 7, 6
    outcomes = rng.integers(-1, 2, size=(R, N)).astype(float)
    played = np.array([6, 6, 3, 1, 2, 5, 4])
    outcomes[np.arange(N)[None] >= played[:, None]] = np.nan
    for k in (1, 2, 4):
        rewards, valid = turn_rewards(outcomes, k)
        assert rewards.shape == valid.shape == (R, N - 1)
        for i, t in itertools.product(range(R), range(N - 1)):
            assert valid[i, t] == (t < played[i] - 1)  # no memory after the last round
            want = sum(outcomes[i, j] for j in range(t + 1, min(t + k, played[i] - 1) + 1)) if valid[i, t] else 0.0
            assert rewards[i, t] == want


# ----------------------------------------------------------------------------------------
# The environment


def test_outcome_and_counter():
    table = {(R_, S_): 1, (P_, R_): 1, (S_, P_): 1, (S_, R_): -1, (R_, P_): -1, (P_, S_): -1}
    for a, b in itertools.product(range(3), repeat=2):
        assert outcome(a, b) == table.get((a, b), 0)
        assert outcome(counter(b), b) == 1


def play(opponent, moves, seed=0, **kw):
    env = RockPaperScissors(RPSConfig(rounds=len(moves), **kw), opponent)
    assert env.reset(seed) == ""
    steps = [env.step(m) for m in moves]
    return env, steps


def test_rps_step_reward_semantics_and_protocol():
    env, steps = play("constant", "RPS??")
    assert isinstance(env, Environment)
    theirs = env.history[0][1]
    for (obs, reward, done), mine in zip(steps[:3], "RPS"):
        assert obs == "=+-"[int(reward)] + mine + MOVES[theirs]
        assert reward == outcome(MOVES.index(mine), theirs)
    assert steps[3][0][1] == "?" and steps[3][1] == -1  # no move named: forfeit
    assert [d for _, _, d in steps] == [False] * 4 + [True]
    with pytest.raises(RuntimeError, match="reset"):
        env.step("R")
    env2, steps2 = play("constant", "RPS??")  # reset(seed) is deterministic
    assert steps2 == steps


def test_rps_first_to_ends_episodes_early():
    env = RockPaperScissors(RPSConfig(rounds=10, first_to=2), "constant")
    env.reset(5)
    win = MOVES[counter(env.draws["move"])]
    assert env.step(win)[2] is False
    assert env.step(win) == ("+" + win + MOVES[env.draws["move"]], 1.0, True)
    for bad in (2.5, True, 0, 11):  # 2.5 ended an episode at 3 wins silently
        with pytest.raises(ValueError, match=f"RPSConfig.first_to={bad!r} must be an int in"):
            RPSConfig(rounds=10, first_to=bad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scripted_opponents(seed):
    rng = np.random.default_rng(seed)
    mine = "".join(MOVES[i] for i in rng.integers(3, size=12))
    their = {}
    for name in OPPONENTS:
        env, _ = play(name, mine, seed=seed, switch_every=4)
        their[name] = [o for _, o in env.history]
    p = [MOVES.index(m) for m in mine]
    assert len(set(their["constant"])) == 1
    assert all(b == (a + 1) % 3 for a, b in zip(their["cycle"], their["cycle"][1:]))
    assert their["copy_last"][1:] == p[:-1]
    assert their["beat_last"][1:] == [counter(x) for x in p[:-1]]
    for t in range(1, 12):
        counts = np.bincount(p[:t], minlength=3)
        assert counts[their["frequency"][t] - 1] == counts.max()  # it counters a most frequent move
        o_prev, p_prev = their["wsls"][t - 1], p[t - 1]
        assert their["wsls"][t] == (o_prev if outcome(o_prev, p_prev) == 1 else (o_prev + 1) % 3)
    sw = their["switch"]
    assert len(set(sw[:4])) == 1 and all(b == (a + 1) % 3 for a, b in zip(sw[4:8], sw[5:8])) and sw[8:12] == p[7:11]


def test_biased_opponent_frequency():
    env, _ = play("biased", "R" * 2000, seed=4, bias=0.8)
    moves = np.bincount([o for _, o in env.history], minlength=3) / 2000
    assert moves[env.draws["move"]] == pytest.approx(0.8, abs=0.03)


def test_rps_config_validation_names_the_field():
    for kw, field in [({"opponents": ("nope",)}, "opponents"), ({"rounds": 1}, "rounds"), ({"first_to": 0}, "first_to"),
                      ({"reward_horizon": 0}, "reward_horizon"), ({"bias": 0.1}, "bias")]:
        with pytest.raises(ValueError, match=f"RPSConfig.{field}"):
            RPSConfig(**kw)


def test_frozen_player_counters_the_memory():
    for m in range(3):
        assert counter_player(f"they play {MOVES[m]}", 0, 0) == MOVES[counter(m)]
    seen = {counter_player("", s, 3) for s in range(30)}
    assert seen == set(MOVES)  # no move named: a random move ...
    assert counter_player("", 7, 2) == counter_player("xyz", 7, 2)  # ... fixed by (seed, round)


# ----------------------------------------------------------------------------------------
# Rollout rows and the miniature (one trained run, module-scoped)

POOL = ("constant", "cycle", "biased")
ROUNDS, MEMORY_TOKENS, B, G = 8, 2, 6, 8
ITERATIONS = 100  # the miniature (slow)
SHORT_ITERATIONS = 4  # the mechanics
EVAL_SEEDS = range(10_000, 10_000 + B * G // len(POOL))  # B*G episodes: the training sampler's shape


def experiment(**env_kw) -> ExperimentConfig:
    env = RPSConfig(opponents=POOL, rounds=ROUNDS, **env_kw)
    return ExperimentConfig(
        model=ModelConfig.tiny(max_seq_len=128),
        data=DataConfig(batch_size=B, seq_len=episode_width(env, MEMORY_TOKENS), pack=False),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=0, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig(steps=ITERATIONS, seed=1, progress=False),
        algorithm=GRPOConfig(collector="rps_memory", environment=env, advantage="turn_level", num_generations=G,
                             max_new_tokens=MEMORY_TOKENS, mu=2, minibatches=2, beta=0.05),
    )


def _train(iterations: int, evaluate: bool) -> dict:
    t0 = time.time()
    cfg = experiment()
    tok = make_tokenizer("byte")
    env = cfg.algorithm.environment
    model = format_warm_start(jaxlm.build_model(cfg.model, seed=1), env, tok, width=cfg.data.seq_len, seed=1)
    trainer = GRPOTrainer(cfg, model, tok)
    state = trainer.init_state()
    initial = jax.tree.map(jnp.copy, state.params)  # the update donates the state
    history = []
    for k in range(iterations):
        state, metrics, samples = trainer.iteration(state, k)
        history.append(metrics)
    result = None
    if evaluate:
        writer = lambda params: lm_writer(trainer.graphdef, params, tok, width=cfg.data.seq_len - MEMORY_TOKENS,
                                          max_new_tokens=MEMORY_TOKENS)
        win = lambda w: win_rates(env, POOL, EVAL_SEEDS, tokenizer=tok, writer=w, rng=jax.random.key(123))
        result = {"no_memory": win(None), "untrained": win(writer(initial)), "trained": win(writer(state.params))}
    return dict(cfg=cfg, tok=tok, trainer=trainer, initial=initial, state=state, history=history,
                samples=samples, result=result, seconds=time.time() - t0)


@pytest.fixture(scope="module")
def run():
    """A few GRPO iterations: the rows, log-probs and collector checks."""
    return _train(SHORT_ITERATIONS, evaluate=False)


@pytest.fixture(scope="module")
def trained():
    """The miniature's full run (slow)."""
    return _train(ITERATIONS, evaluate=True)


def check_rows(exp, tok, cfg, played):
    """Every row: bos, then per turn t the round-t observation (loss 0, turn t) and the
    memory (loss 1, turn t); env tokens never trained; padding unattended."""
    rows = exp.rows
    R = rows["tokens"].shape[0]
    for i in range(R):
        n = int(rows["attend"][i].sum())
        assert rows["attend"][i, :n].all() and not rows["attend"][i, n:].any()
        assert not rows["loss_mask"][i, n:].any() and rows["tokens"][i, 0] == tok.bos_id
        pos, turns = 1, 0
        while pos < n:
            t = rows["turn"][i, pos]
            seg = tok.encode(SEGMENT.format(obs=played.observations[i][t]))
            assert rows["tokens"][i, pos : pos + len(seg)].tolist() == seg
            span = slice(pos, pos + len(seg))
            assert not rows["loss_mask"][i, span].any() and (rows["turn"][i, span] == t).all()
            pos += len(seg)
            end = pos
            while end < n and rows["loss_mask"][i, end]:
                end += 1
            # the policy span right after the context: 1..max_new_tokens sampled tokens, same turn
            assert 1 <= end - pos <= cfg.algorithm.max_new_tokens, (i, t, end - pos)
            assert (rows["turn"][i, pos:end] == t).all(), (i, t)
            assert tok.decode(rows["tokens"][i, pos:end]) == played.memories[i][t + 1]  # the memory round t+1 used
            assert t == turns
            pos, turns = end, turns + 1
        assert turns == int(exp.valid.reshape(R, -1)[i].sum())
    assert np.all(rows["sampler_logp"][~rows["loss_mask"]] == 0)


@pytest.mark.parametrize("first_to", [None, 3])
def test_rollout_rows_and_exact_logprob_recompute(run, first_to):
    cfg = experiment(first_to=first_to)
    tok, trainer = run["tok"], run["trainer"]
    collector = COLLECTORS["rps_memory"](cfg, trainer.graphdef, tok)
    params = run["initial"]
    exp = collector(params, 0, jax.random.key(0))
    R = B * G
    assert exp.rewards.shape == exp.valid.shape == (B, G, ROUNDS - 1)
    # Replay the same episodes (same specs, rng) to read the observations and memories.
    played = play_rps(cfg.algorithm.environment, collector.specs(0), tokenizer=tok, num_generations=G,
                      writer=lm_writer(trainer.graphdef, params, tok, width=cfg.data.seq_len - MEMORY_TOKENS,
                                       max_new_tokens=MEMORY_TOKENS), rng=jax.random.key(0))
    np.testing.assert_array_equal(played.stream.tokens[5], exp.rows["tokens"][5, : len(played.stream.tokens[5])])
    check_rows(exp, tok, cfg, played)
    rewards, valid = turn_rewards(played.outcomes, 1)
    np.testing.assert_array_equal(exp.rewards.reshape(R, -1), rewards)
    lengths = valid.sum(1)
    if first_to is None:
        assert (lengths == ROUNDS - 1).all()
    else:
        assert lengths.min() < lengths.max()  # episodes of different lengths in one batch
    # Old log-probs recomputed by one forward pass over each row (`row_logprobs`, what the
    # trainer's ratio uses) = the KV-cache sampler's, token by token.
    lp, _ = trainer.logprob_fn(params, {k: jnp.asarray(exp.rows[k]) for k in ("tokens", "positions", "attend")})
    m = exp.rows["loss_mask"]
    np.testing.assert_allclose(np.asarray(lp)[m], exp.rows["sampler_logp"][m], atol=2e-5)
    _, prep = trainer.prepare(run["state"].replace(params=params), exp)
    assert prep["sampler_mismatch"] < 2e-5


def test_training_keeps_sampler_and_trainer_logprobs_equal(run):
    worst = max(m["sampler_mismatch"] for m in run["history"])
    assert worst < 2e-5
    assert all(np.isfinite(m["loss"]) for m in run["history"])


@pytest.mark.slow
def test_trained_memory_writer_beats_no_memory_and_untrained(trained):
    """The claim in miniature: after GRPO the frozen player wins far more often with the
    trained writer's memory than with no memory (1/3 by symmetry) or the warm-started writer."""
    run = trained
    res = run["result"]
    rounds = len(EVAL_SEEDS) * len(POOL) * (ROUNDS - 1)
    print(f"\nMemoPilot RPS miniature ({ITERATIONS} GRPO iterations, {run['seconds']:.0f} s incl. warm start; "
          f"win rate over {rounds} held-out rounds):")
    for name, r in res.items():
        print(f"  {name:10s} " + "  ".join(f"{k}={v:.3f}" for k, v in r.items()))
    print("  sample:", run["samples"][0])
    assert abs(res["no_memory"]["all"] - 1 / 3) < 0.08
    assert abs(res["untrained"]["all"] - 1 / 3) < 0.08  # the warm start learned the format, not the content
    assert res["trained"]["all"] > res["no_memory"]["all"] + 0.1
    assert res["trained"]["all"] > res["untrained"]["all"] + 0.1
    last = run["history"][-10:]
    assert np.mean([m["memory_valid"] for m in last]) > 0.9


# ----------------------------------------------------------------------------------------
# Config


def test_collector_needs_an_environment_and_room(run):
    cfg = experiment()
    tok, trainer = run["tok"], run["trainer"]
    bad = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, environment=None))
    with pytest.raises(ValueError, match="GRPOConfig.environment"):
        COLLECTORS["rps_memory"](bad, trainer.graphdef, tok)
    short = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=20))
    with pytest.raises(ValueError, match="data.seq_len"):
        COLLECTORS["rps_memory"](short, trainer.graphdef, tok)


def test_recipe_loads_and_overrides_the_environment():
    cfg = load_config("memopilot_rps", ["algorithm.environment.rounds=6", "algorithm.environment.first_to=3"])
    env = cfg.algorithm.environment
    assert (env.rounds, env.first_to) == (6, 3)
    assert (cfg.algorithm.collector, cfg.algorithm.advantage) == ("rps_memory", "turn_level")
    with pytest.raises(ConfigError, match="RPSConfig.rounds"):
        load_config("memopilot_rps", ["algorithm.environment.rounds=1"])


@pytest.mark.slow
def test_recipe_end_to_end(tmp_path):
    """The documented two commands: the warm start, then ``jaxlm train`` (2 iterations)."""
    import json

    from trainers.loop import train
    from trainers.rl.memopilot_warmstart import main

    main([str(tmp_path / "sft"), "--config", "memopilot_rps", "--steps", "20"])
    cfg = load_config("memopilot_rps", [f"trainer.out_dir={tmp_path / 'run'}", f"init_from={tmp_path / 'sft' / 'model'}",
                                        "trainer.steps=2", "trainer.log_every=1", "trainer.progress=false"])
    result = train(cfg)
    assert result.step == 2 and (tmp_path / "run" / "model").exists()
    logged = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in logged if r.get("kind") == "train"]
    assert len(train_rows) == 2 and all("win_rate" in r and r["sampler_mismatch"] < 2e-5 for r in train_rows)
