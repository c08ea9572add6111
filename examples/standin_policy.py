"""The model stand-in's scripted policy (examples/model_standin.py): what it answers, per task.

The scripted policy:

* ``guess_number`` (see ``examples.envserver``): reads the range ("between LOW and HIGH")
  and the feedback ("N is too low/high") from the conversation and binary-searches.  Like
  a model thinking aloud, each reply restates the remaining range
  (``"The number is in range [26, 49]. My guess: 37"``) so the search survives the
  driver trimming old turns; the guess is always the last number of the reply.
* ``arithmetic``: evaluates the "What is <expression>?" of the last user message and
  answers correctly with probability ``skill`` (default 0.7), else off by one.  The die
  is seeded from the messages, the temperature, ``fault_seed`` and a request counter, so
  identical requests (the samples of one group) may get different answers.
* ``<answer>`` prompts (reasoning-gym's system prompts): the last arithmetic expression of the
  last user message, evaluated like ``arithmetic`` (right with probability ``skill``) and
  answered as ``<answer>N</answer>``.
* textarena's GuessTheNumber ("wrapped in square brackets", "The target number is
  higher/lower."): the same binary search, the guess written as ``[N]``.
* anything else: ``"I don't know"``.
* the bundled tool task (``examples/agents/``): a request that offers a function tool named
  ``calculator`` and whose last message is the user's "What is <expression>?" is answered with
  a ``tool_calls`` call of ``calculator`` on that expression (``finish_reason: "tool_calls"``,
  no content); one whose last message is that tool's result (role ``tool``) is answered
  ``"The answer is R. <answer>R</answer>"`` with R the result, as a model that trusts its tool.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

# The name GET /models lists: interactor's --model default, so that a run against the stand-in
# needs no --model, while one against a real server that lists other names is refused without it
# (interactor/preflight.py).
STANDIN_MODEL_NAME = "stand-in"

_RANGE_RE = re.compile(r"between\s+(-?\d+)\s+and\s+(-?\d+)", re.I)
_STATE_RE = re.compile(r"range\s*\[\s*(-?\d+)\s*,\s*(-?\d+)\s*\]", re.I)
_FEEDBACK_RE = re.compile(r"(-?\d+)\s+is\s+too\s+(low|high)", re.I)
_INT_RE = re.compile(r"-?\d+")
_EXPR_RE = re.compile(r"[-+*/×÷()\d\s.]*\d[-+*/×÷()\d\s.]*")
_QUESTION_RE = re.compile(r"what\s+is\s+([-+*/×÷xX()\d\s.]*\d[-+*/×÷xX()\d\s.]*)", re.I)


def message_text(content: Any) -> str:
    """Text of a message content: a string, None, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text") or ""))
        return "\n".join(texts)
    return str(content)


def _guess_number(msgs: list[tuple[str, str]]) -> str | None:
    if not any(r in ("system", "user") and "guess" in t.lower() for r, t in msgs):
        return None
    orig = None
    for role, text in msgs:
        if role in ("system", "user"):
            m = _RANGE_RE.search(text)
            if m:
                orig = (int(m.group(1)), int(m.group(2)))
                break
    state = None
    for role, text in msgs:
        if role == "assistant":
            found = _STATE_RE.findall(text)
            if found:
                state = (int(found[-1][0]), int(found[-1][1]))
                break
    if orig is None and state is None:
        return None
    lo, hi = orig if orig is not None else state
    last_guess = None
    for role, text in msgs:
        if role == "assistant":
            found = _STATE_RE.findall(text)
            if found:  # the range it had before its guess: tighten, never widen
                lo, hi = max(lo, int(found[-1][0])), min(hi, int(found[-1][1]))
            ints = _INT_RE.findall(text)
            last_guess = int(ints[-1]) if ints else None
        elif role == "user":
            fb = _FEEDBACK_RE.findall(text)
            if not fb and last_guess is not None:
                low = text.lower()
                if "too low" in low or "number is higher" in low:
                    fb = [(str(last_guess), "low")]
                elif "too high" in low or "number is lower" in low:
                    fb = [(str(last_guess), "high")]
            for g, direction in fb:
                if direction.lower() == "low":
                    lo = max(lo, int(g) + 1)
                else:
                    hi = min(hi, int(g) - 1)
    if lo > hi:  # inconsistent (trimmed or odd feedback): start over
        lo, hi = orig if orig is not None else state
    guess = (lo + hi) // 2
    if any("square brackets" in t.lower() for r, t in msgs if r in ("system", "user")):
        return f"The number is in range [{lo}, {hi}]. My guess: [{guess}]"  # textarena's format
    return f"The number is in range [{lo}, {hi}]. My guess: {guess}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("unsupported expression")


def _arithmetic(msgs: list[tuple[str, str]], rng: random.Random, skill: float) -> str | None:
    user_texts = [t for r, t in msgs if r == "user"]
    if not user_texts:
        return None
    m = _QUESTION_RE.search(user_texts[-1])
    if not m:
        return None
    expr = m.group(1).replace("×", "*").replace("÷", "/").replace("x", "*").replace("X", "*")
    try:
        value = _eval(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    value = _with_skill(value, rng, skill)
    return f"Let me compute {m.group(1).strip()}. The answer is {value}"


def _with_skill(value: float, rng: random.Random, skill: float) -> float:
    """The right answer with probability ``skill``, else off by one (so group rewards vary)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if rng.random() >= skill:
        value = value + rng.choice((-1, 1))
    if isinstance(value, float):
        value = round(value, 6)
    return value


def _tagged_answer(msgs: list[tuple[str, str]], rng: random.Random, skill: float) -> str | None:
    if not any("<answer>" in t for r, t in msgs if r in ("system", "user")):
        return None
    user_texts = [t for r, t in msgs if r == "user"]
    if not user_texts:
        return None
    value = None
    for m in reversed(list(_EXPR_RE.finditer(user_texts[-1].replace("×", "*").replace("÷", "/")))):
        expr = m.group(0).strip().rstrip(".").strip()
        if not any(op in expr[1:] for op in "+-*/"):
            continue
        try:
            value = _eval(ast.parse(expr, mode="eval"))
            break
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
            continue
    if value is None:
        return "I don't know. <answer>unknown</answer>"
    value = _with_skill(value, rng, skill)
    return f"Let me compute it step by step. <answer>{value}</answer>"


TOOL_NAME = "calculator"


def offers_tool(tools: Any, name: str = TOOL_NAME) -> bool:
    """Whether a request's ``tools`` offers a function tool called ``name``."""
    return isinstance(tools, list) and any(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") == name
        for t in tools)


def tool_reply(messages: list, tools: Any, call_id: str) -> tuple[str | None, list | None] | None:
    """The bundled tool task's answer, (content, tool_calls), or None when the request is not
    one of it (see the module docstring)."""
    if not offers_tool(tools) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") == "tool":
        result = message_text(last.get("content")).strip()
        return f"The answer is {result}. <answer>{result}</answer>", None
    if last.get("role") != "user":
        return None
    m = _QUESTION_RE.search(message_text(last.get("content")))
    if not m:
        return None
    expression = m.group(1).strip().rstrip(".")
    call = {"id": call_id, "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": expression})}}
    return None, [call]


def scripted_reply(messages: list[dict], rng: random.Random, skill: float = 0.7) -> str:
    """The stand-in policy: the reply text for a list of chat messages."""
    msgs = [(str(m.get("role", "")), message_text(m.get("content")))
            for m in messages if isinstance(m, dict)]
    for attempt in (lambda: _guess_number(msgs), lambda: _tagged_answer(msgs, rng, skill),
                    lambda: _arithmetic(msgs, rng, skill)):
        reply = attempt()
        if reply is not None:
            return reply
    return "I don't know"
