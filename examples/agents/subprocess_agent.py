"""An agent as a process of its own (``agent_command: [python3, -m, examples.agents.subprocess_agent]``):
it reads the task row as JSON on stdin, finds the gateway in OPENAI_BASE_URL / OPENAI_API_KEY and
the model's name in INTERACTOR_MODEL, as any OpenAI client would, and prints its reward as its
last line of stdout: ``{"reward": 1.0, "info": {...}}``."""

from __future__ import annotations

import json
import os
import sys

from examples.agents.openai_client import solve


def main() -> int:
    task = json.loads(sys.stdin.read())
    if task.get("fail"):
        print("the task asked this agent to fail", file=sys.stderr)
        return 3
    result = solve(task, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["INTERACTOR_MODEL"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
