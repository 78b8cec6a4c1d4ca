"""Agentic RL: multi-turn episodes on the engine, token in and token out, with loss masks.

An agent loop is user code over a model handle (`async def run(sample, model) -> Trajectory`); the
built-in loops call tools (ToolAgentLoop) or talk to a gym-style environment (EnvAgentLoop). The
trajectory keeps the exact tokens the model saw and sampled: nothing is re-tokenized, and the tokens
the policy did not sample (tool output, environment text, the template between turns) are masked out
of the loss. `run_episodes` runs many episodes at once on one continuously batched engine."""

from hybridflow.agents.conversation import Conversation
from hybridflow.agents.environment import EnvAgentLoop, Environment
from hybridflow.agents.model import Completion, EngineModel
from hybridflow.agents.runner import AgentLoop, run_episodes
from hybridflow.agents.tool_loop import ToolAgentLoop
from hybridflow.agents.tools import Tool
from hybridflow.agents.trajectory import Trajectory

__all__ = [
    "AgentLoop",
    "Completion",
    "Conversation",
    "EngineModel",
    "EnvAgentLoop",
    "Environment",
    "Tool",
    "ToolAgentLoop",
    "Trajectory",
    "run_episodes",
]
