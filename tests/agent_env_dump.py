"""An agent process that says what it was given (``agent_command: [python, -m,
tests.agent_env_dump]``): its environment's names and its OPENAI_* values, into the task row's
``marks`` folder; then one call through the gateway and its reward line."""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI


def main() -> int:
    task = json.loads(sys.stdin.read())
    seen = {"names": sorted(os.environ), "OPENAI_BASE_URL": os.environ.get("OPENAI_BASE_URL"),
            "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY"), "INTERACTOR_MODEL": os.environ.get("INTERACTOR_MODEL")}
    with open(os.path.join(task["marks"], "env.json"), "w") as f:
        json.dump(seen, f)
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
    client.chat.completions.create(model=os.environ["INTERACTOR_MODEL"],
                                   messages=[{"role": "user", "content": "What is 3 + 3?"}])
    print(json.dumps({"reward": 1.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
