"""MemoPilot (card B.3; "From Player to Master", arXiv 2606.08656): a frozen player plays
multi-round Rock-Paper-Scissors, a trainable memory writer (the GRPO policy) rewrites a
text memory after every round, and multi-turn GRPO trains the writer with turn-wise
rewards and the context-independent turn-level advantage (``advantage="turn_level"``).

One episode against opponent ``o`` with seed ``s`` (`trainers.rl.environments`)::

    m_0 = ""
    round t = 0, 1, ...:   a_t = player(m_t)              (frozen)   -> outcome_t in {+1, 0, -1}
    turn t (if round t+1 follows):   m_{t+1} ~ writer(episode so far)   (trained)
    turn-wise reward  r_t = outcome_{t+1} + ... + outcome_{t+k}          (k = RPSConfig.reward_horizon)

The memory written at turn t is first used in round t+1 (card: "k=1 default"); no memory
is written after the last round (nothing would read it), so an episode of n rounds has
n - 1 turns and ``rewards [B, G, K]`` pads the turns it did not reach (``valid`` False,
K = rounds - 1). G rollouts play the same ``(opponent, seed)``: the opponent's and the
player's random draws depend only on ``(seed, round)``, so rollouts differ only through
their memories.

**Player**: frozen, one of two (``RPSConfig.player``). ``lm`` is the paper's setting: a
frozen jaxlm model (`lm_player`) that reads ``"<dice>|<memory>|"`` and answers with a move
letter, greedily; `player_warm_start` SFTs it to play the counter of the first move the
memory names and, when it names none, the move its dice digit gives (the dice depends only
on ``(seed, round)``, so G rollouts of a group still differ only through their memories); an
answer naming no move forfeits the round. ``scripted`` (`counter_player`) is that rule
written as code, the player a perfectly compliant LM would be: it isolates what is trained
(the writer) and costs no forward pass. The no-memory baseline is either player with
``m = ""`` every round.

**Writer context**: one row per episode (`trainers.rl.multiturn`): ``[bos]`` then, per
turn, the round just played as ``"<+|=|-><ours><theirs>"`` (e.g. ``"-RP"``, context,
``loss_mask`` 0) and the sampled memory (``loss_mask`` 1, ending with EOS unless it hit
``max_new_tokens``). The writer therefore reads the whole episode so far (including its
own earlier memories), a superset of the paper's ``(m_{t-1}, transcript_t)``.

**Warm start**: a randomly initialised byte model almost never writes a move letter, so
the writer starts from `format_warm_start`: a few SFT steps on episodes whose memories
are uniformly random move letters. It learns the format (one letter, then EOS), not the
content, so its win rate equals the no-memory baseline's; GRPO must learn what to write
(``python -m trainers.rl.memopilot_warmstart OUT`` writes ``OUT/model`` for ``init_from``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlm
from trainers.rl.collectors import COLLECTORS, Experience
from trainers.rl.environments import MOVES, RockPaperScissors, RPSConfig, counter, parse_move
from trainers.rl.multiturn import TurnRows, sample_turn
from trainers.rl.rollout import left_pad, positions_of, row_logprobs, sample_block

SEGMENT = "{obs}"
"""The context the writer reads before writing each memory (obs: ``"-RP"``)."""
SEGMENT_LEN = 3


def player_dice(seed: int, round_index: int) -> int:
    """The player's random move index when the memory names none; depends only on ``(seed, round)``."""
    return int(np.random.default_rng([seed, round_index, 0x91A7]).integers(3))


def counter_player(memory: str, seed: int, round_index: int) -> str:
    """The scripted frozen player: the counter of the move the memory names (the opponent's
    predicted move), else the random move ``player_dice(seed, round)``."""
    predicted = parse_move(memory)
    if predicted is None:
        return MOVES[player_dice(seed, round_index)]
    return MOVES[counter(predicted)]


Player = Callable[[Sequence[str], Sequence[int], int], list[str]]
"""``player(memories, seeds, round) -> move texts``, one per active episode."""


def scripted_player(memories: Sequence[str], seeds: Sequence[int], round_index: int) -> list[str]:
    return [counter_player(m, s, round_index) for m, s in zip(memories, seeds)]


PLAYER_PROMPT = "{dice}|{memory}|"
"""What the LM player reads (after BOS): its dice digit and the memory."""


def player_prompt(memory: str, seed: int, round_index: int) -> str:
    return PLAYER_PROMPT.format(dice=player_dice(seed, round_index), memory=memory)


def lm_player(graphdef, params, tokenizer, *, bucket: int = 8) -> Player:
    """A frozen jaxlm model as the player: greedy, one token per round, prompts left-padded
    to a multiple of ``bucket`` tokens (few compiled shapes)."""

    def play(memories, seeds, round_index):
        ids = [tokenizer.encode(player_prompt(m, s, round_index), add_bos=True) for m, s in zip(memories, seeds)]
        width = -(-max(map(len, ids)) // bucket) * bucket
        block, mask = left_pad(ids, width, tokenizer.pad_id)
        final = sample_block(graphdef, params, block, mask, jax.random.key(0), max_new_tokens=1, temperature=0,
                             top_p=None, pad_id=tokenizer.pad_id, stop_tokens=())
        return [tokenizer.decode([t]) for t in np.asarray(final.tokens[:, 0])]

    return play


def random_memory(rng: np.random.Generator) -> str:
    """A memory as a writer might leave it: empty, a move letter, or 1-2 characters of which
    any may be a move letter or another printable byte (the player's SFT inputs)."""
    kind = rng.random()
    if kind < 0.2:
        return ""
    if kind < 0.5:
        return MOVES[int(rng.integers(3))]
    chars = [MOVES[int(rng.integers(3))] if rng.random() < 0.4 else chr(int(rng.integers(32, 127)))
             for _ in range(int(rng.integers(1, 3)))]
    return "".join(chars)


def player_warm_start(config, tokenizer, *, steps: int = 400, batch_size: int = 64, lr: float = 3e-3,
                      seed: int = 0):
    """A frozen LM player: a ``config`` model SFT'd on ``"<dice>|<memory>|" -> move`` with the
    target `counter_player`'s move, on `random_memory` memories and random ``(seed, round)``."""
    rng = np.random.default_rng([seed, 0x5EED])
    n = 64 * batch_size
    memories = [random_memory(rng) for _ in range(n)]
    seeds, rounds = rng.integers(0, 2**31, n), rng.integers(0, 64, n)
    texts = [player_prompt(m, int(s), int(t)) for m, s, t in zip(memories, seeds, rounds)]
    targets = [counter_player(m, int(s), int(t)) for m, s, t in zip(memories, seeds, rounds)]
    ids = [tokenizer.encode(x, add_bos=True) + tokenizer.encode(y) for x, y in zip(texts, targets)]
    width = max(map(len, ids))
    block, attend = left_pad(ids, width, tokenizer.pad_id)
    loss_mask = np.zeros_like(attend)
    loss_mask[:, -1] = True  # the move letter is the only target
    data = {"tokens": jnp.asarray(block), "attend": jnp.asarray(attend),
            "positions": jnp.asarray(positions_of(attend)), "loss_mask": jnp.asarray(loss_mask)}
    model = sft_on_rows(jaxlm.build_model(config, seed=seed), data, steps=steps, batch_size=batch_size, lr=lr,
                        rng=rng)
    model.tokenizer = tokenizer
    return model


def sft_on_rows(model, data: dict, *, steps: int, batch_size: int, lr: float, rng: np.random.Generator):
    """A copy of ``model`` after ``steps`` Adam steps of masked NLL on rows ``data``
    (``tokens``/``attend``/``positions``/``loss_mask``), minibatches drawn by ``rng``."""
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tx = optax.adam(lr)

    def loss_fn(p, batch):
        lp = row_logprobs(nnx.merge(graphdef, p), batch)
        m = batch["loss_mask"].astype(jnp.float32)
        return -(lp * m).sum() / jnp.maximum(m.sum(), 1.0)

    @jax.jit
    def step(p, opt, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        upd, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, upd), opt, loss

    opt = tx.init(params)
    n = data["tokens"].shape[0]
    for _ in range(steps):
        idx = rng.choice(n, batch_size, replace=False)
        params, opt, _ = step(params, opt, {k: v[idx] for k, v in data.items()})
    return nnx.merge(graphdef, params)


def load_player(cfg: RPSConfig, tokenizer) -> Player:
    """The player ``cfg`` names (``lm``: its checkpoint loaded once, frozen)."""
    if cfg.player == "scripted":
        return scripted_player

    model = jaxlm.load_checkpoint(cfg.player_model)
    graphdef, params = nnx.split(model)
    return lm_player(graphdef, params, getattr(model, "tokenizer", None) or tokenizer)


def episode_width(cfg: RPSConfig, max_new_tokens: int) -> int:
    """Tokens of the longest episode row: bos + (rounds - 1) x (segment + memory)."""
    return 1 + (cfg.rounds - 1) * (SEGMENT_LEN + max_new_tokens)


def turn_rewards(outcomes: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-round outcomes ``[R, rounds]`` (NaN after an episode's end) -> turn-wise rewards
    and validity ``[R, rounds - 1]``: ``r_t = sum_{j=t+1}^{min(t+k, n-1)} outcome_j`` for the
    turns ``t < n - 1`` of an episode of n rounds."""
    R, N = outcomes.shape
    played = (~np.isnan(outcomes)).sum(1)
    o = np.nan_to_num(outcomes, nan=0.0)
    c = np.concatenate([np.zeros((R, 1)), np.cumsum(o, 1)], 1)  # c[:, j] = sum of rounds < j
    t = np.arange(N - 1)
    hi = np.minimum(t[None, :] + horizon + 1, N)
    rewards = np.take_along_axis(c, hi, 1) - c[:, 1:N]
    valid = t[None, :] < played[:, None] - 1
    return np.where(valid, rewards, 0.0).astype(np.float32), valid


@dataclasses.dataclass
class Episodes:
    """What `play_rps` returns: per rollout, the round outcomes ``[R, rounds]`` (NaN where
    not played), the memory each round used, the observations, and the writer's rows."""

    outcomes: np.ndarray
    memories: list[list[str]]
    observations: list[list[str]]
    stream: TurnRows | None

    def win_rate(self, mask: np.ndarray | None = None) -> float:
        """Wins per round among the rounds that used a written memory (round >= 1)."""
        o = self.outcomes[:, 1:]
        played = ~np.isnan(o)
        if mask is not None:
            played &= mask[:, None]
        return float((o[played] == 1).sum() / max(played.sum(), 1))


Writer = Callable[[list[list[int]], jax.Array], tuple[list[list[int]], list[list[float]]]]


def lm_writer(graphdef, params, tokenizer, *, width: int, max_new_tokens: int, temperature: float = 1.0,
              top_p: float | None = None, prompt_sharding=None) -> Writer:
    """The memory writer: a jaxlm policy sampled with the KV-cache sampler (`sample_turn`;
    ``prompt_sharding``: the streams split over devices)."""
    eos = tokenizer.eos_id

    def write(prefixes, rng):
        return sample_turn(
            graphdef, params, prefixes, width=width, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, rng=rng, pad_id=tokenizer.pad_id, stop_tokens=() if eos is None else (eos,),
            prompt_sharding=prompt_sharding,
        )

    return write


def play_rps(cfg: RPSConfig, specs: Sequence[tuple[str, int]], *, tokenizer, writer: Writer | None,
             num_generations: int = 1, rng: jax.Array | None = None, player: Player = scripted_player) -> Episodes:
    """Play ``num_generations`` episodes per ``(opponent, seed)`` (rollout ``i*G + g``).
    ``writer=None``: the no-memory baseline (the player always sees ``m = ""``)."""
    G = num_generations
    envs = [(RockPaperScissors(cfg, opp), seed) for opp, seed in specs for _ in range(G)]
    R = len(envs)
    obs = [env.reset(seed) for env, seed in envs]
    memory = [""] * R
    active = np.ones(R, bool)
    outcomes = np.full((R, cfg.rounds), np.nan)
    memories: list[list[str]] = [[] for _ in range(R)]
    observations: list[list[str]] = [[] for _ in range(R)]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    stream = TurnRows(R, bos) if writer is not None else None
    rng = jax.random.key(0) if rng is None else rng
    for t in range(cfg.rounds):
        playing = np.flatnonzero(active)
        moves = player([memory[i] for i in playing], [envs[i][1] for i in playing], t)
        for i, move in zip(playing, moves):
            env, seed = envs[i]
            memories[i].append(memory[i])
            obs[i], reward, done = env.step(move)
            observations[i].append(obs[i])
            outcomes[i, t] = reward
            active[i] = not done
        if t == cfg.rounds - 1 or not active.any() or writer is None:
            continue
        for i in np.flatnonzero(active):  # turn t: the writer reads the round just played ...
            stream.add_context(i, tokenizer.encode(SEGMENT.format(obs=obs[i])), turn=t)
        tokens, logps = writer(stream.tokens, jax.random.fold_in(rng, t))  # ... and writes m_{t+1}
        for i in np.flatnonzero(active):
            stream.add_policy(i, tokens[i], logps[i], turn=t)
            memory[i] = tokenizer.decode(tokens[i])
    return Episodes(outcomes=outcomes, memories=memories, observations=observations, stream=stream)


class MemoPilotCollector:
    """``data.batch_size`` groups per iteration, each ``(opponent, seed)`` with opponent
    ``RPSConfig.opponents[(k*B + i) % len]`` and a seed from ``(trainer.seed, k, i)``, played
    ``num_generations`` times; rewards ``[B, G, rounds - 1]`` per memory update."""

    def __init__(self, cfg, graphdef, tokenizer):
        a = cfg.algorithm
        env = getattr(a, "environment", None)
        if not isinstance(env, RPSConfig):
            raise ValueError(
                f"GRPOConfig.environment={env!r} is invalid for collector='rps_memory': must be an RPSConfig"
            )
        self.cfg, self.env, self.graphdef, self.tokenizer = cfg, env, graphdef, tokenizer
        self.prompt_sharding = None  # GRPOTrainer: the episodes' streams split over its mesh
        self.player = load_player(env, tokenizer)
        self.width = cfg.data.seq_len
        need = episode_width(env, a.max_new_tokens)
        if need > self.width:
            raise ValueError(
                f"data.seq_len={self.width} is too short for RPSConfig.rounds={env.rounds} with "
                f"algorithm.max_new_tokens={a.max_new_tokens}: an episode needs up to {need} tokens"
            )

    def specs(self, iteration: int) -> list[tuple[str, int]]:
        B, pool = self.cfg.data.batch_size, self.env.opponents
        base = (self.cfg.trainer.seed * 1_000_003 + iteration * B) * 7919
        return [(pool[(iteration * B + i) % len(pool)], base + i) for i in range(B)]

    def __call__(self, params, iteration: int, rng) -> Experience:
        a, B = self.cfg.algorithm, self.cfg.data.batch_size
        G = a.num_generations
        specs = self.specs(iteration)
        writer = lm_writer(self.graphdef, params, self.tokenizer, width=self.width - a.max_new_tokens,
                           max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                           prompt_sharding=self.prompt_sharding)
        ep = play_rps(self.env, specs, tokenizer=self.tokenizer, writer=writer, num_generations=G, rng=rng,
                      player=self.player)
        rows = ep.stream.rows(self.width, self.tokenizer.pad_id)
        rewards, valid = turn_rewards(ep.outcomes, self.env.reward_horizon)
        K = rewards.shape[1]
        written = [m for ms in ep.memories for m in ms[1:]]
        metrics = {
            "win_rate": ep.win_rate(),
            "reward": float(rewards[valid].mean()) if valid.any() else 0.0,
            "memory_valid": float(np.mean([parse_move(m) is not None for m in written])) if written else 0.0,
            "episode_rounds": float((~np.isnan(ep.outcomes)).sum(1).mean()),
            "policy_tokens_per_turn": float(rows["loss_mask"].sum() / max(valid.sum(), 1)),
        }
        opponents = np.repeat([o for o, _ in specs], G)
        for name in sorted(set(opponents)):
            metrics[f"win_rate/{name}"] = ep.win_rate(opponents == name)
        samples = [{"opponent": o, "seed": s, "episode": self.tokenizer.decode(ep.stream.tokens[i * G]),
                    "win_rate": ep.win_rate(np.arange(B * G) == i * G)} for i, (o, s) in enumerate(specs)]
        return Experience(rows=rows, rewards=rewards.reshape(B, G, K), valid=valid.reshape(B, G, K),
                          metrics=metrics, samples=samples)


@COLLECTORS.register("rps_memory")
def rps_memory(cfg, graphdef, tokenizer, *, base_params=None):
    return MemoPilotCollector(cfg, graphdef, tokenizer)


def win_rates(cfg: RPSConfig, opponents: Sequence[str], seeds: Sequence[int], *, tokenizer,
              writer: Writer | None, rng: jax.Array | None = None, player: Player = scripted_player) -> dict[str, float]:
    """The player's win rate per opponent (rounds >= 1) over ``seeds``, and ``"all"``."""
    specs = [(o, s) for o in opponents for s in seeds]
    ep = play_rps(cfg, specs, tokenizer=tokenizer, writer=writer, rng=rng, player=player)
    names = np.asarray([o for o, _ in specs])
    out = {o: ep.win_rate(names == o) for o in opponents}
    out["all"] = ep.win_rate()
    return out


def random_letter_writer(seed: int, tokenizer) -> Writer:
    """Memories that are a uniformly random move letter then EOS (the warm start's data)."""
    rng = np.random.default_rng(seed)
    tail = [] if tokenizer.eos_id is None else [tokenizer.eos_id]

    def write(prefixes, _):
        ids = [tokenizer.encode(MOVES[int(rng.integers(3))]) + tail for _ in prefixes]
        return ids, [[0.0] * len(x) for x in ids]

    return write


def format_warm_start(model, cfg: RPSConfig, tokenizer, *, width: int, steps: int = 150, batch_size: int = 32,
                      lr: float = 3e-3, seed: int = 0):
    """A copy of ``model`` SFT'd on episodes with random one-letter memories: the writer learns
    the memory format (a move letter, then EOS) and nothing about which letter to write."""
    specs = [(cfg.opponents[i % len(cfg.opponents)], 10_000_000 + seed * 100_003 + i) for i in range(8 * batch_size)]
    ep = play_rps(cfg, specs, tokenizer=tokenizer, writer=random_letter_writer(seed, tokenizer))
    rows = ep.stream.rows(width, tokenizer.pad_id)
    data = {k: jnp.asarray(rows[k]) for k in ("tokens", "attend", "positions", "loss_mask")}
    return sft_on_rows(model, data, steps=steps, batch_size=batch_size, lr=lr, rng=np.random.default_rng(seed))
