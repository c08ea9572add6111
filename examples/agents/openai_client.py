"""An agent on the plain ``openai`` client: ask, run the tool calls the model makes, ask again,
until it answers without one (at most ``max_turns``). Run as ``agent: examples.agents.openai_client:solve``."""

from __future__ import annotations

import json

from openai import OpenAI

from examples.agents.calculator import TOOL, calculate, reward


def solve(task: dict, base_url: str, api_key: str, model: str, max_turns: int = 6) -> dict:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict] = [{"role": "system", "content": "Use the calculator tool, then answer as <answer>N</answer>."},
                            {"role": "user", "content": task["question"]}]
    answer = ""
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except (ValueError, KeyError, SyntaxError, ZeroDivisionError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": reward(task, answer), "info": {"answer": answer}}
