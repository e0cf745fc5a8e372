"""Agent tasks by name (``AGENT_TASKS``) and the config that picks one for training.

A task is anything with ``episode(index) -> Episode`` (deterministic in ``index``). Registered
factories take an `AgentTaskConfig`: ``lakeqa`` (`jaxlm.agents.lakeqa`, ``hops`` hops),
``speaker`` (`jaxlm.agents.speaker`) and ``ctf`` (`jaxlm.agents.crypto`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxlm.agents.crypto import CTFTask
from jaxlm.agents.lakeqa import LakeQATask
from jaxlm.agents.loop import AgentConfig, Episode
from jaxlm.agents.speaker import SpeakerTask
from jaxlm.registry import Registry


class AgentTask(Protocol):
    def episode(self, index: int) -> Episode: ...


AGENT_TASKS: Registry = Registry("agent task")


@dataclasses.dataclass(frozen=True)
class AgentTaskConfig:
    """The tool-use task multi-turn GRPO trains on (``GRPOConfig.agent``) and the loop's budgets."""

    task: str = "lakeqa"
    """A registered task (`AGENT_TASKS`): lakeqa | speaker | ctf."""
    seed: int = 0
    """The task's generator seed (episode i of iteration k is task index k * batch_size + i)."""
    hops: int = 2
    """lakeqa: hops per question (1: a person's company, 2: its city, 3: its country)."""
    system: str | None = None
    """The system prompt (None: the task's own)."""
    loop: AgentConfig = AgentConfig()
    """Turn, tool-call and token budgets of each episode."""

    def __post_init__(self):
        if self.task not in AGENT_TASKS:
            raise ValueError(f"AgentTaskConfig.task={self.task!r} is not registered: one of {sorted(AGENT_TASKS)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"AgentTaskConfig.seed={self.seed!r} must be an int >= 0")

    def build(self) -> AgentTask:
        return AGENT_TASKS[self.task](self)


def _system(cfg: AgentTaskConfig, default: str) -> str:
    return default if cfg.system is None else cfg.system


@AGENT_TASKS.register("lakeqa")
def _lakeqa(cfg: AgentTaskConfig) -> LakeQATask:
    return LakeQATask(seed=cfg.seed, hops=cfg.hops, system=_system(cfg, LakeQATask.system))


@AGENT_TASKS.register("speaker")
def _speaker(cfg: AgentTaskConfig) -> SpeakerTask:
    return SpeakerTask(seed=cfg.seed, system=_system(cfg, SpeakerTask.system))


@AGENT_TASKS.register("ctf")
def _ctf(cfg: AgentTaskConfig) -> CTFTask:
    return CTFTask(seed=cfg.seed, system=_system(cfg, CTFTask.system))
