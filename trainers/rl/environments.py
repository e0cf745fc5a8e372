"""Text environments for multi-turn RL: the `Environment` protocol and multi-round
Rock-Paper-Scissors against scripted, exploitable opponents (MemoPilot's cheapest testbed,
card B.3; arXiv 2606.08656).

An environment is stepped with text and answers with text::

    env = RockPaperScissors(RPSConfig(rounds=5), "cycle")
    obs = env.reset(seed=3)              # "" (nothing has happened yet)
    obs, reward, done = env.step("P")    # e.g. "+PR": we won, playing P against their R

``reward`` is +1 win / 0 draw / -1 loss for the side calling ``step``; a text naming no
move (no R, P or S in it) forfeits the round (-1). An episode is ``RPSConfig.rounds``
rounds, or fewer with ``first_to``: it ends as soon as either side has that many wins,
so episodes of the same group can differ in length.

Opponents (``OPPONENTS``) are seeded by ``reset(seed)``; every random draw depends only on
``(seed, round)``, so G episodes against the same ``(opponent, seed)`` differ only through
what the player did. Their regularities [INFERRED from the card's list]:

- ``constant``: one move, chosen by the seed;
- ``cycle``: R -> P -> S -> R ... from a seeded start;
- ``biased``: a seeded favourite move with probability ``RPSConfig.bias``, else uniform
  over the other two;
- ``frequency``: the counter of the player's most frequent move so far (ties: the latest);
- ``wsls``: win-stay / lose-shift: repeat its move after a win, else play the next move
  in R -> P -> S;
- ``copy_last``: the player's previous move;
- ``beat_last``: the counter of the player's previous move;
- ``switch``: constant, then cycle, then copy_last, ... changing every
  ``RPSConfig.switch_every`` rounds (a mixture that switches).

The first round of every opponent but ``constant``/``cycle``/``biased``/``switch`` is a
seeded random move (there is no history yet).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from jaxlm.registry import Registry

MOVES = "RPS"


def counter(move: int) -> int:
    """The move that beats ``move`` (R=0 < P=1 < S=2 < R)."""
    return (move + 1) % 3


def outcome(player: int, opponent: int) -> int:
    """+1 if ``player`` beats ``opponent``, 0 on a draw, -1 otherwise."""
    return (0, 1, -1)[(player - opponent) % 3]


def parse_move(text: str) -> int | None:
    """The first of R, P, S in ``text`` (0, 1, 2), or None."""
    for ch in text:
        i = MOVES.find(ch)
        if i >= 0:
            return i
    return None


@runtime_checkable
class Environment(Protocol):
    """A multi-turn text environment. ``reset`` starts an episode (deterministic in
    ``seed``) and returns the first observation; ``step`` takes the acting side's text and
    returns ``(observation, reward, done)``; stepping a finished episode is an error."""

    def reset(self, seed: int) -> str: ...

    def step(self, text: str) -> tuple[str, float, bool]: ...


@dataclasses.dataclass(frozen=True)
class RPSConfig:
    """Multi-round Rock-Paper-Scissors for MemoPilot (card B.3). ``GRPOConfig.environment``."""

    opponents: tuple[str, ...] = ("constant", "cycle", "biased", "frequency", "wsls", "copy_last", "beat_last")
    """The scripted opponent pool (`OPPONENTS`); group i of iteration k plays opponent
    ``opponents[(k * batch_size + i) % len(opponents)]``."""
    rounds: int = 10
    """Rounds per episode (the card suggests 20-50 with an LLM player; short here for CPU)."""
    first_to: int | None = None
    """End an episode as soon as either side has this many wins (variable-length episodes);
    None: always ``rounds`` rounds (the paper's fixed-length setting)."""
    reward_horizon: int = 1
    """[INFERRED] turn-wise reward of memory update t: the summed outcomes of the next
    ``reward_horizon`` rounds (the card's k; k=1: the round that first uses memory t)."""
    bias: float = 0.8
    """``biased`` opponent: probability of its favourite move."""
    switch_every: int = 4
    """``switch`` opponent: rounds between strategy changes."""
    player: str = "scripted"
    """The frozen player (`trainers.rl.memopilot`): ``scripted`` (`counter_player`, the
    counter of the move the memory names) or ``lm`` (a frozen jaxlm model SFT'd to do the same,
    `player_warm_start`; the paper's player is a frozen LLM)."""
    player_model: str | None = None
    """``player="lm"``: the frozen player's checkpoint directory (`jaxlm.load_checkpoint`)."""

    def __post_init__(self):
        if not self.opponents:
            raise ValueError("RPSConfig.opponents is empty: name at least one opponent")
        for name in self.opponents:
            if name not in OPPONENTS:
                raise ValueError(f"RPSConfig.opponents has {name!r}: must be one of {sorted(OPPONENTS)}")
        for name in ("rounds", "reward_horizon", "switch_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"RPSConfig.{name}={v!r} is invalid: must be a positive int")
        if self.rounds < 2:
            raise ValueError(f"RPSConfig.rounds={self.rounds} must be >= 2 (a memory is used from round 2 on)")
        if self.first_to is not None and (isinstance(self.first_to, bool) or not isinstance(self.first_to, int)
                                          or not 1 <= self.first_to <= self.rounds):  # 2.5 ended at 3 wins
            raise ValueError(f"RPSConfig.first_to={self.first_to!r} must be an int in [1, rounds={self.rounds}] "
                             "(or None)")
        if not 1 / 3 <= self.bias <= 1:
            raise ValueError(f"RPSConfig.bias={self.bias!r} must be in [1/3, 1]")
        if self.player not in ("scripted", "lm"):
            raise ValueError(f"RPSConfig.player={self.player!r} is invalid: must be 'scripted' or 'lm'")
        if self.player == "lm" and not self.player_model:
            raise ValueError("RPSConfig.player_model is required with player='lm': the frozen player's checkpoint "
                             "(python -m trainers.rl.memopilot_warmstart OUT --player writes OUT/player)")


# An opponent: (history of (player, opponent) moves, seed's per-episode draws, round rng, cfg) -> move.
Opponent = Callable[[list, dict, np.random.Generator, RPSConfig], int]
OPPONENTS: Registry = Registry("RPS opponent")


def _episode_draws(seed: int) -> dict:
    rng = np.random.default_rng([seed, 0x5EED])
    return {"move": int(rng.integers(3)), "start": int(rng.integers(3))}


@OPPONENTS.register("constant")
def _constant(history, draws, rng, cfg):
    return draws["move"]


@OPPONENTS.register("cycle")
def _cycle(history, draws, rng, cfg):
    return (draws["start"] + len(history)) % 3


@OPPONENTS.register("biased")
def _biased(history, draws, rng, cfg):
    if rng.random() < cfg.bias:
        return draws["move"]
    return (draws["move"] + 1 + int(rng.integers(2))) % 3


@OPPONENTS.register("frequency")
def _frequency(history, draws, rng, cfg):
    if not history:
        return int(rng.integers(3))
    counts = np.bincount([p for p, _ in history], minlength=3)
    best = np.flatnonzero(counts == counts.max())
    latest = max(best, key=lambda m: max(i for i, (p, _) in enumerate(history) if p == m))
    return counter(int(latest))


@OPPONENTS.register("wsls")
def _wsls(history, draws, rng, cfg):
    if not history:
        return int(rng.integers(3))
    p, o = history[-1]
    return o if outcome(o, p) == 1 else (o + 1) % 3


@OPPONENTS.register("copy_last")
def _copy_last(history, draws, rng, cfg):
    return history[-1][0] if history else int(rng.integers(3))


@OPPONENTS.register("beat_last")
def _beat_last(history, draws, rng, cfg):
    return counter(history[-1][0]) if history else int(rng.integers(3))


@OPPONENTS.register("switch")
def _switch(history, draws, rng, cfg):
    phase = (len(history) // cfg.switch_every) % 3
    return (_constant, _cycle, _copy_last)[phase](history, draws, rng, cfg)


class RockPaperScissors:
    """One episode at a time against ``opponent``. Observations are the round just played,
    ``<+|=|-><our move><their move>`` (``?`` for a forfeited move), ``""`` after reset.
    Their move comes last: a policy reading the transcript predicts from the newest token."""

    def __init__(self, cfg: RPSConfig, opponent: str):
        self.cfg = cfg
        self.name = opponent
        self.opponent = OPPONENTS[opponent]
        self.history: list[tuple[int, int]] = []
        self.wins = [0, 0]
        self.done = True
        self.seed = 0

    def reset(self, seed: int) -> str:
        self.seed = int(seed)
        self.draws = _episode_draws(self.seed)
        self.history, self.wins, self.done = [], [0, 0], False
        return ""

    def step(self, text: str) -> tuple[str, float, bool]:
        if self.done:
            raise RuntimeError("step() on a finished episode: call reset(seed) first")
        rng = np.random.default_rng([self.seed, len(self.history), 0x0990])
        theirs = int(self.opponent(self.history, self.draws, rng, self.cfg))
        mine = parse_move(text)
        if mine is None:  # forfeit: the round counts as lost; their history sees a random move
            reward, mine_logged = -1, int(rng.integers(3))
        else:
            reward, mine_logged = outcome(mine, theirs), mine
        self.history.append((mine_logged, theirs))
        self.wins[0] += reward == 1
        self.wins[1] += reward == -1
        first_to = self.cfg.first_to
        self.done = len(self.history) >= self.cfg.rounds or (first_to is not None and max(self.wins) >= first_to)
        obs = "=+-"[reward] + ("?" if mine is None else MOVES[mine]) + MOVES[theirs]
        return obs, float(reward), self.done
