"""Against the original system's env server as it answers (tests/original_envserver.py): a
constructor that fails alike on every reset is bad parameters after two resets, though each 500
names another process, actor and address (workers/http_errors.py error_signature)."""

from __future__ import annotations

import random
import textwrap
import time

import pytest

from broker import errors
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from producer.enqueue import submit
from tests.conftest import wait_for
from tests.original_envserver import OriginalEnvServer, ray_creation_error
from workers.http_errors import error_signature

# Two tries of one bad reset as the original server answered them (its 500 detail, the dead
# actor's pid, id and address differing), and what else such answers hold.
MISSING_TASK = "FileNotFoundError: only_task_id=99 not found in /data/dabstep/tasks/dev_tasks.jsonl"
TRY_1 = ("Reset execution failed: The actor died because of an error raised in its creation task, "
         "\x1b[36mray::EnvActor.__init__()\x1b[39m (pid=15481, ip=127.0.0.1, "
         "actor_id=6e13c661a3f8d1c2e5b7a9d001000000, repr=<env.app.EnvActor object at 0x7fdf93742390>)\n"
         '  File "/srv/env/app.py", line 212, in __init__\n    self.env = env_cls(**env_param)\n'
         f"{MISSING_TASK}")
TRY_2 = TRY_1.replace("15481", "15792").replace("6e13c661a3f8d1c2e5b7a9d0", "b7373f95c02e4a1d9f6b8e13") \
             .replace("0x7fdf93742390", "0x7f655783a090").replace("\x1b[36m", "").replace("\x1b[39m", "")


@pytest.mark.unit
def test_two_tries_of_one_bad_reset_have_one_signature():
    assert TRY_1 != TRY_2
    assert error_signature(TRY_1) == error_signature(TRY_2)
    masked = error_signature(TRY_1)
    for gone in ("15481", "6e13c661", "0x7fdf93742390", "\x1b["):
        assert gone not in masked
    # what says why stays
    assert "ray::EnvActor.__init__()" in masked and masked.endswith(MISSING_TASK)


@pytest.mark.unit
def test_other_failures_keep_other_signatures():
    other_error = TRY_2.replace(MISSING_TASK, "ValueError: Math500TextEnv requires dataset fields: problem, answer")
    other_task = TRY_2.replace("only_task_id=99", "only_task_id=98")
    assert len({error_signature(t) for t in (TRY_1, other_error, other_task)}) == 3
    # plain numbers are not masked: another row, another line, another error
    assert error_signature("KeyError: row 3 has no 'answer'") != error_signature("KeyError: row 4 has no 'answer'")


@pytest.mark.parametrize("first, second", [
    # times in a logged line, and the log's process prefix
    ("2026-11-28 00:48:32,118 ERROR (EnvActor pid=15481) reset failed: no such split 'dev2'",
     "2026-11-28 00:48:34,502 ERROR (EnvActor pid=15792) reset failed: no such split 'dev2'"),
    ("[00:48:32.118] worker_id=9a0c1e reset failed", "[00:48:39.007] worker_id=77d2f1 reset failed"),
    # request ids and other long hex ids
    ("request 3f2b9c1e-7a4d-4e8b-9c0f-1a2b3c4d5e6f: constructor raised",
     "request 0d9e8f7a-6b5c-4d3e-8f1a-2b3c4d5e6f70: constructor raised"),
    ("object ffffffffffffffff8a3c000001000000 lost", "object ffffffffffffffff1b7e000001000000 lost"),
])
@pytest.mark.unit
def test_times_and_ids_are_masked(first, second):
    assert first != second and error_signature(first) == error_signature(second)


@pytest.mark.unit
def test_the_stand_ins_answers_differ_on_every_try_and_share_a_signature():
    rng = random.Random(1)
    texts = {ray_creation_error("EnvActor", MISSING_TASK, rng) for _ in range(5)}
    assert len(texts) == 5 and len({error_signature(t) for t in texts}) == 1


@pytest.mark.integration
def test_a_constructor_that_fails_alike_is_bad_parameters_after_two_resets(settings, procs, model_server,
                                                                             redis_client, tmp_path):
    """A dabstepgym task naming a task id its data does not have: the original server answers
    every reset 500, each time naming another dead actor. The worker's second reset sees the
    same error and dead-letters the episode as env_bad_request (permanent) at once: two resets
    in all, where every try of every attempt used to be spent (4 tries x 3 attempts = 12)."""
    server = OriginalEnvServer(["dabstepgym"], fails=lambda name, p: MISSING_TASK if p.get("only_task_id") == "99" else None)
    env_url = server.start()
    try:
        _, model_url = model_server
        s = settings.replace(llm_base_url=model_url + "/v1", max_attempts=3, env_retries=3)
        procs.settings = s
        tasks = tmp_path / "dabstep.yaml"
        tasks.write_text(textwrap.dedent(f"""\
            environments:
              - env_name: dabstepgym
                base_url: {env_url}
                env_params: {{data_dir: /data/dabstep, split: dev, only_task_id: "99", max_steps: 6, timeout: 60}}
                env_num: 1
            """))
        sub = submit(redis_client, s, [str(tasks)])
        job = sub.job.job_id
        ledger = Ledger(redis_client, Keys(s.key_prefix))
        procs.worker("w1")
        wait_for(lambda: ledger.counts(job)["failed"] == 1, 120, what="the episode dead-lettered")
        (letter,) = DeadLetterQueue(redis_client, s).list(job_id=job)
        time.sleep(1.0)  # nothing else is tried after the dead letter
        resets = [r for r in server.resets if r["env_name"] == "dabstepgym"]
        print(f"\nresets at the server: {len(resets)}; 500 details: {len(set(server.answered_500))} distinct")
        assert letter.reason == errors.ENV_BAD_REQUEST, letter.error
        assert "twice with the same error" in letter.error and MISSING_TASK in letter.error
        assert letter.attempts == 1
        assert len(resets) == 2, [r["env_id"] for r in resets]
        assert len(set(server.answered_500)) == 2  # the texts differed: only their signatures matched
    finally:
        server.shutdown()
