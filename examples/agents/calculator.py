"""The bundled tool task: a question "What is <expression>?", a calculator tool, and the reward
(1.0 when the agent's final answer, ``<answer>N</answer>`` or the last number it says, equals
the row's ``answer``). Shared by the example agents in this folder."""

from __future__ import annotations

import ast
import operator
import re

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression and returns the result.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The tool: +, -, *, / and parentheses over numbers, nothing else (no eval)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")

    value = ev(ast.parse(expression, mode="eval"))
    return str(int(value)) if float(value).is_integer() else str(value)


def reward(task: dict, final_answer: str) -> float:
    tagged = re.findall(r"<answer>\s*(-?[\d.]+)\s*</answer>", final_answer or "")
    numbers = tagged or re.findall(r"-?\d+(?:\.\d+)?", final_answer or "")
    if not numbers:
        return 0.0
    try:
        return 1.0 if abs(float(numbers[-1]) - float(task["answer"])) < 1e-9 else 0.0
    except (KeyError, TypeError, ValueError):
        return 0.0
