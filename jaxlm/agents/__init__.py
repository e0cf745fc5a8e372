"""Tool-use agents: typed tools, tool-call parsing, the batched agent loop and its
trajectories, and task harnesses (LakeQA-style search over a data lake, DramaSR-style
speaker attribution, AICrypto-style multiple choice / capture-the-flag / proofs)."""

from jaxlm.agents.loop import AgentConfig, Episode, ModelPolicy, Policy, Trajectory, run_episodes
from jaxlm.agents.parsing import Reply, ToolCall, parse_reply
from jaxlm.agents.tasks import AGENT_TASKS, AgentTaskConfig
from jaxlm.agents.tools import Tool, Toolbox, ToolResult, tool

__all__ = ["AGENT_TASKS", "AgentConfig", "AgentTaskConfig", "Episode", "ModelPolicy", "Policy", "Reply", "Tool",
           "ToolCall", "ToolResult", "Toolbox", "Trajectory", "parse_reply", "run_episodes", "tool"]
