"""An agent on LangGraph: a prebuilt ReAct agent over ``langchain-openai``'s chat model on the
gateway, with the calculator as its tool. Run as ``agent: examples.agents.langgraph_agent:solve``."""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from examples.agents.calculator import calculate, reward


@tool
def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns the result."""
    return calculate(expression)


def solve(task: dict, base_url: str, api_key: str, model: str) -> dict:
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0, temperature=0)
    graph = create_react_agent(llm, [calculator],
                               prompt="Use the calculator tool, then answer as <answer>N</answer>.")
    state = graph.invoke({"messages": [("user", task["question"])]}, {"recursion_limit": 12})
    answer = str(state["messages"][-1].content or "")
    return {"reward": reward(task, answer), "info": {"answer": answer}}
