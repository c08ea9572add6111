"""What token-exact trajectories cost on disk: the same episodes written through the real
store with and without their token ids and logprobs."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.benchlog import log


@dataclass
class TokenStorageResult:
    episodes: int = 0
    turns: int = 0
    sampled_tokens: int = 0  # completion ids: what the model sampled
    stored_ids: int = 0  # prompt ids + completion ids, as stored per step
    token_bytes: int = 0  # ids and logprobs as stored (the step_tokens blobs)
    json_bytes: int = 0  # the same ids and logprobs as JSON text of numbers
    texts_bytes: int = 0  # the sampled tokens' strings kept for the browser
    file_growth_bytes: int = 0  # the SQLite file with tokens minus the same job without
    errors: list[str] = field(default_factory=list)

    @property
    def bytes_per_stored_id(self) -> float:
        return self.token_bytes / max(1, self.stored_ids)

    @property
    def bytes_per_sampled_token(self) -> float:
        return self.token_bytes / max(1, self.sampled_tokens)


def run_token_storage(work: Path, *, episodes: int = 200, turns: int = 5, system_tokens: int = 600,
                      env_tokens: int = 80, completion_tokens: int = 150) -> TokenStorageResult:
    """What token-exact trajectories cost on disk: full-history episodes (each turn's prompt is
    the last one plus the answer and the env's reply) written through the real store twice,
    with and without their token fields; ids packed int32 and logprobs float32 (broker/tokens.py)
    against the same numbers as JSON text."""
    import random

    from broker.records import StepRecord
    from broker.tokens import TOKENS_OK, pack_ids, pack_logprobs
    from consumer.storage import open_store

    res = TokenStorageResult(episodes=episodes, turns=turns)
    rng = random.Random(7)
    folder = Path(tempfile.mkdtemp(prefix="tokens-", dir=work))
    try:
        sizes = {}
        for with_tokens in (False, True):
            path = folder / f"{'with' if with_tokens else 'without'}.sqlite"
            store = open_store(str(path))
            for e in range(episodes):
                prompt = [rng.randrange(50_000) for _ in range(system_tokens)]
                batch = []
                for t in range(1, turns + 1):
                    completion = [rng.randrange(50_000) for _ in range(completion_tokens)]
                    logprobs = [-rng.random() * 4 for _ in completion]
                    texts = [f"tok{i % 997}" for i in completion]
                    step = StepRecord(
                        job_id="bench-tokens", env_id=f"bench-tokens.e{e}", attempt=1, step_id=t, env_name="chat",
                        llm_model="stand-in", group_id=f"g{e // 4}", messages_json=b"[]", response="x" * 600,
                        step_reward=0.0, cumulative_reward=0.0, terminated=t == turns, truncated=False,
                        episode_finished=t == turns, is_trainable=True, attempt_id=f"a{e}",
                        prompt_tokens=len(prompt), completion_tokens=len(completion))
                    if with_tokens:
                        step.token_source, step.token_status = "vllm", TOKENS_OK
                        step.prompt_ids, step.completion_ids = pack_ids(prompt), pack_ids(completion)
                        step.completion_logprobs = pack_logprobs(logprobs)
                        step.completion_token_texts = texts
                        res.sampled_tokens += len(completion)
                        res.stored_ids += len(prompt) + len(completion)
                        res.token_bytes += len(step.prompt_ids) + len(step.completion_ids) + len(
                            step.completion_logprobs)
                        res.json_bytes += len(json.dumps(prompt)) + len(json.dumps(completion)) + len(
                            json.dumps(logprobs))
                        res.texts_bytes += sum(len(x) for x in texts)
                    batch.append(step)
                    prompt = prompt + completion + [rng.randrange(50_000) for _ in range(env_tokens)]
                store.write_batch(batch)
            store.close()
            sizes[with_tokens] = sum(p.stat().st_size for p in folder.glob(path.name + "*"))
        res.file_growth_bytes = sizes[True] - sizes[False]
    except Exception as exc:
        res.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    log(f"token storage: {res.bytes_per_stored_id:.2f} bytes per stored id, {res.bytes_per_sampled_token:.1f} per "
        f"sampled token (JSON text: {res.json_bytes / max(1, res.stored_ids):.2f} per id)")
    return res
