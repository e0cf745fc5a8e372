"""A jaxlm model in the agent loop: `ModelPolicy` through `jaxlm.generate`, and multi-turn
GRPO's ``agent`` collector, whose rows train on the policy's replies only and whose sampler
log-probs one forward over the row reproduces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.agents import AgentConfig, AgentTaskConfig, ModelPolicy, run_episodes
from jaxlm.agents.lakeqa import LakeQATask
from jaxlm.data.pipeline import DataConfig
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig
from trainers.loop import make_tokenizer
from trainers.rl.collectors import COLLECTORS
from trainers.rl.loop import GRPOTrainer

B, G, WIDTH, NEW = 2, 2, 320, 24
SYSTEM = "Tools: search(query)."


def experiment() -> ExperimentConfig:
    agent = AgentTaskConfig(task="lakeqa", hops=1, system=SYSTEM, loop=AgentConfig(max_turns=3))
    return ExperimentConfig(
        model=ModelConfig.tiny(max_seq_len=WIDTH),
        data=DataConfig(batch_size=B, seq_len=WIDTH, pack=False),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant"),
        trainer=TrainerConfig(steps=2, seed=0, progress=False),
        algorithm=GRPOConfig(collector="agent", agent=agent, num_generations=G, max_new_tokens=NEW))


@pytest.fixture(scope="module")
def trainer():
    cfg = experiment()
    tok = make_tokenizer("byte")
    return GRPOTrainer(cfg, jaxlm.build_model(cfg.model, seed=0), tok)


def test_model_policy_runs_episodes_of_a_random_model():
    model = jaxlm.build_model(ModelConfig.tiny(max_seq_len=256, init_std=0.5), seed=1,
                              tokenizer=jaxlm.data.tokenizers.ByteTokenizer())
    task = LakeQATask(hops=1, system=SYSTEM)
    cfg = AgentConfig(max_turns=2, max_new_tokens=16, max_episode_tokens=256)
    got = run_episodes(ModelPolicy(model), [task.episode(i) for i in range(3)], cfg)
    again = run_episodes(ModelPolicy(model), [task.episode(i) for i in range(3)], cfg)
    assert [t.messages for t in got] == [t.messages for t in again]  # greedy: deterministic
    for t in got:
        assert t.stop in ("answer", "max_turns", "token_budget") and t.turns >= 1
        assert t.tokens <= 256 and t.reward in (0.0, 1.0)


def test_agent_rows_train_on_replies_and_recompute_the_sampler_logprobs(trainer):
    cfg = experiment()
    collector = COLLECTORS["agent"](cfg, trainer.graphdef, trainer.tokenizer)
    state = trainer.init_state()
    exp = collector(state.params, 0, jax.random.key(0))
    rows = exp.rows
    assert rows["tokens"].shape == (B * G, WIDTH) and exp.rewards.shape == (B, G)
    assert set(np.unique(exp.rewards)) <= {0.0, 1.0}
    tok = trainer.tokenizer
    for i in range(B * G):
        n = int(rows["attend"][i].sum())
        text = tok.decode(rows["tokens"][i, 1:n])
        assert text.startswith(f"<|system|>\n{SYSTEM}\n<|user|>\n"), text[:80]
        assert not rows["loss_mask"][i, n:].any()
        # every trained span directly follows an assistant generation prompt
        starts = np.flatnonzero(rows["loss_mask"][i, :n] & ~np.r_[False, rows["loss_mask"][i, : n - 1]])
        assert len(starts) >= 1
        for s in starts:
            assert tok.decode(rows["tokens"][i, s - len("<|assistant|>\n"): s]) == "<|assistant|>\n"
    assert np.all(rows["sampler_logp"][~rows["loss_mask"]] == 0)
    lp, _ = trainer.logprob_fn(state.params, {k: jnp.asarray(rows[k]) for k in ("tokens", "positions", "attend")})
    m = rows["loss_mask"]
    np.testing.assert_allclose(np.asarray(lp)[m], rows["sampler_logp"][m], atol=2e-5)
    for key in ("reward", "answered", "turns", "tool_calls", "tool_errors", "episode_tokens"):
        assert np.isfinite(exp.metrics[key])


def test_grpo_iterations_on_the_agent_task(trainer):
    state = trainer.init_state()
    for k in range(2):
        state, metrics, samples = trainer.iteration(state, k)
        assert np.isfinite(metrics["loss"]) and metrics["sampler_mismatch"] < 2e-5
    assert samples and "<|user|>" in samples[0]["episode"]


def test_agent_collector_needs_its_task():
    with pytest.raises(ValueError, match="collector='agent' needs GRPOConfig.agent"):
        GRPOConfig(collector="agent")
    with pytest.raises(ValueError, match="AgentTaskConfig.task='nope' is not registered"):
        AgentTaskConfig(task="nope")
