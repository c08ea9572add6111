"""The task file the integration tests run most: ``arithmetic`` over rows the stand-in model
answers ("What is i + (i + 3)?"), optionally after a ``guess_number`` environment. Kept in one
place so that a test needing the same job (the batch runner's, the feed's) does not copy it."""

from __future__ import annotations

import json
import textwrap


def write_arith_tasks(folder, env_url: str, *, rows: int, env_num: int, guess: int = 0, extra: str = "") -> str:
    """Writes ``arith.jsonl`` and ``tasks.yaml`` into ``folder``; returns the task file's path.
    ``guess``: that many ``guess_number`` episodes first (none when 0); ``extra``: YAML appended
    (more environments, each entry indented by two spaces, as these are)."""
    (folder / "arith.jsonl").write_text("".join(
        json.dumps({"question": f"What is {i} + {i + 3}?", "answer": 2 * i + 3}) + "\n" for i in range(rows)))
    guess_env = textwrap.indent(textwrap.dedent(f"""\
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{low: 1, high: 64, max_turns: 10}}
            env_num: {guess}
        """), "  ") if guess else ""
    path = folder / "tasks.yaml"
    path.write_text("environments:\n" + guess_env + textwrap.indent(textwrap.dedent(f"""\
          - env_name: arithmetic
            base_url: {env_url}
            env_params: {{}}
            dataset: arith.jsonl
            env_num: {env_num}
        """), "  ") + extra)
    return str(path)
