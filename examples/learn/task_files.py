"""The task files of the learning demo, made from envs/antonyms.py's splits (one source for the
words): ``train.yaml``, the feed's continuous job, and ``heldout.yaml``, the evaluation job.
Both ask for token ids and logprobs (``tokens: true``); evaluation needs none, but it then runs
exactly the requests the trainer's samples come from.

    python -m examples.learn.task_files OUT_DIR --env-base-url http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from envs.antonyms import split

# What every request of the demo asks of llama-server, training and evaluation alike: the model's
# own distribution (temperature 1, nothing cut off by top-k, top-p or min-p), so that the
# server's logprobs are the probabilities the tokens were drawn with.
SAMPLING = ["--temperature", "1", "--top-p", "1", "--llm-params", json.dumps({"top_k": 0, "min_p": 0.0}),
            "--max-tokens", "20"]


def task_file(split_name: str, env_base_url: str, group_size: int) -> str:
    # quoted: YAML reads a bare on, yes or true as a boolean, and the env refuses it as a word
    rows = "\n".join(f"      - {{word: {json.dumps(w)}}}" for w in split(split_name))
    return (f"# the antonym task's {split_name} split (envs/antonyms.py), {group_size} episodes per word\n"
            "tokens: true\n"
            "environments:\n"
            "  - env_name: antonym\n"
            f"    base_url: {env_base_url}\n"
            f"    env_num: {group_size}\n"
            "    dataset:\n"
            f"{rows}\n")


def write(out_dir: str | Path, env_base_url: str, train_group: int = 8, heldout_samples: int = 4) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = out / "train.yaml", out / "heldout.yaml"
    train.write_text(task_file("train", env_base_url, train_group))
    heldout.write_text(task_file("heldout", env_base_url, heldout_samples))
    return train, heldout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.learn.task_files", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--env-base-url", required=True)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--heldout-samples", type=int, default=4)
    a = p.parse_args(argv)
    for path in write(a.out_dir, a.env_base_url, a.group_size, a.heldout_samples):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
