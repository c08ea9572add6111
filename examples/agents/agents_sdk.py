"""An agent on the OpenAI Agents SDK (``openai-agents``): one agent with a function tool, its
model an OpenAI chat-completions model on the gateway. Run as ``agent: examples.agents.agents_sdk:solve``.
Tracing is off: it would send traces to OpenAI's servers."""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from examples.agents.calculator import calculate, reward

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns the result."""
    return calculate(expression)


def solve(task: dict, base_url: str, api_key: str, model: str) -> dict:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="calculator", instructions="Use the calculator tool, then answer as <answer>N</answer>.",
                  tools=[calculator], model=OpenAIChatCompletionsModel(model=model, openai_client=client))
    result = Runner.run_sync(agent, task["question"], max_turns=6, run_config=RunConfig(tracing_disabled=True))
    answer = str(result.final_output or "")
    return {"reward": reward(task, answer), "info": {"answer": answer}}
