"""Every change made to a job leaves an entry in its audit log (broker/audit.py), with who and
when: a pause on a failure streak, a resume, a cancel, a dead-letter re-drive (the command's and
the browser's); ``--as`` signs them; ``interactor job JOB log`` and ``status JOB`` show them.
Against the session's real Redis; the commands run as processes."""

from __future__ import annotations

import json

from broker import errors
from broker.audit import JobAudit, default_who
from broker.dlq import DeadLetterQueue
from broker.keys import Keys
from broker.ledger import Ledger
from broker.pause import STREAK_WHO, JobPause
from broker.records import DeadLetter
from broker.states import AttemptStatus, LedgerState
from tests.test_ledger import JOB, attempt_rec, ep_id, make_job
from tests.test_recovery import cli


def _fail(ledger: Ledger, i: int) -> None:
    """Episode ``i`` started and dead-lettered for good."""
    lease = ledger.start(JOB, ep_id(i), "w1").lease
    rec = attempt_rec(lease, AttemptStatus.FAILED, reason=errors.ENV_UNREACHABLE)
    letter = DeadLetter(job_id=JOB, episode_id=ep_id(i), group_id=f"{JOB}.1.1.1", env_name="arith",
                        reason=errors.ENV_UNREACHABLE, error="down",
                        attempts=1, spec={"queue": "q"})
    assert ledger.finish(lease, rec, LedgerState.FAILED, dead_letter=letter)


def test_pause_resume_redrive_cancel_each_leave_an_entry(settings, redis_client):
    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(redis_client, settings)
    job, eps = make_job()
    ledger.create_job(job, eps)
    audit = JobAudit(redis_client, keys)
    pause = JobPause(redis_client, keys)
    for i in (1, 2):
        _fail(ledger, i)
        paused = pause.record(JOB, errors.ENV_UNREACHABLE, 2, detail="connection refused", episode_id=ep_id(i))
    assert paused and len(audit.entries(JOB)) == 1
    (entry,) = audit.entries(JOB)
    assert entry["action"] == "pause" and entry["who"] == STREAK_WHO
    assert entry["detail"]["reason"] == errors.ENV_UNREACHABLE and entry["detail"]["streak"] == 2

    out = cli(settings, "resume", JOB, "--as", "alice")
    assert out.returncode == 0, out.stderr
    newest = audit.entries(JOB)[0]
    assert newest["action"] == "resume" and newest["who"] == "alice" and "paused" in newest["detail"]["was"]
    out = cli(settings, "resume", JOB)  # not paused: nothing changed, nothing logged
    assert out.returncode == 0 and len(audit.entries(JOB)) == 2

    out = cli(settings, "dlq", "redrive", ep_id(1), "--as", "bob")
    assert out.returncode == 0 and "re-drove 1" in out.stdout, out.stdout + out.stderr
    newest = audit.entries(JOB)[0]
    assert (newest["action"], newest["who"], newest["detail"]["episodes"]) == ("redrive", "bob", [ep_id(1)])
    # the job's own user@host when no --as
    sent = DeadLetterQueue(redis_client, settings).redrive_failed(JOB)
    assert sent == [ep_id(2)] and audit.entries(JOB)[0]["who"] == default_who()

    out = cli(settings, "cancel", JOB, "--wait", "0", "--as", "carol")
    assert out.returncode == 0, out.stderr
    newest = audit.entries(JOB)[0]
    assert newest["action"] == "cancel" and newest["who"] == "carol" and newest["detail"]["waiting_cancelled"] > 0
    cli(settings, "cancel", JOB, "--wait", "0")  # cancelled already: not a second change
    assert [e["action"] for e in audit.entries(JOB)] == ["cancel", "redrive", "redrive", "resume", "pause"]

    out = cli(settings, "job", JOB, "log")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split("  ")[2] for line in lines[:-1]] == ["pause", "resume", "redrive", "redrive", "cancel"]
    assert "carol" in lines[-2] and lines[-1] == f"5 changes to job {JOB}"
    as_json = json.loads(cli(settings, "job", JOB, "log", "--json").stdout)
    assert [e["action"] for e in as_json][0] == "pause" and as_json[-1]["who"] == "carol"
    status = cli(settings, "status", JOB)
    assert "changes    " in status.stdout and "carol  cancel" in status.stdout, status.stdout


def test_log_of_an_unknown_job_is_a_clear_error(settings):
    out = cli(settings, "job", "no-such-job", "log")
    assert out.returncode == 2 and "no job 'no-such-job'" in out.stderr and "Traceback" not in out.stderr


def test_browser_redrive_is_signed_with_the_client_address(settings, redis_client, tmp_path):
    from consumer.storage import open_store
    from interactor.ui.app import create_app
    from interactor.ui.source import LiveState, Source

    ledger = Ledger.for_settings(redis_client, settings)
    job, eps = make_job()
    ledger.create_job(job, eps)
    _fail(ledger, 3)
    path = str(tmp_path / "results.sqlite")
    open_store(path).close()
    token = "t0ken-" + "x" * 20
    source = Source(open_store(path, readonly=True), store_shown=path, live=LiveState(settings))
    client = create_app(source, allow_actions=True, token=token).test_client()
    resp = client.post("/dead-letters/redrive", data={"episode_id": ep_id(3), "token": token},
                       headers={"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"},
                       environ_base={"REMOTE_ADDR": "10.1.2.3"})
    assert resp.status_code == 303, resp.data[:300]
    newest = JobAudit(redis_client, Keys(settings.key_prefix)).entries(JOB)[0]
    assert newest["action"] == "redrive" and newest["who"] == "browser @ 10.1.2.3"


def test_the_store_keeps_the_log_and_the_job_page_shows_it_after_redis_is_gone(settings, redis_client, tmp_path):
    """Each entry is also a record on the results stream; stored (twice: harmless), the job
    page shows the log newest first, its text escaped, with no Redis."""
    from broker.records import unpack
    from consumer.storage import job_audit, open_store
    from interactor.ui.app import create_app
    from interactor.ui.source import Source

    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(redis_client, settings)
    job, eps = make_job()
    ledger.create_job(job, eps)
    audit = JobAudit(redis_client, keys)
    audit.record(JOB, "set", {"concurrency": 8}, who="alice")
    audit.record(JOB, "rerun", {"episodes": [ep_id(1)]}, who="<script>alert(1)</script>")
    records = [unpack(fields[b"r"]) for _, fields in redis_client.xrange(keys.results)]
    path = str(tmp_path / "results.sqlite")
    store = open_store(path)
    try:
        store.write_batch(records)
        store.write_batch(records)  # a redelivered batch changes nothing
        got = job_audit.entries(store, JOB)
    finally:
        store.close()
    assert [(e["action"], e["who"]) for e in got] == [("rerun", "<script>alert(1)</script>"), ("set", "alice")]
    assert got[1]["detail"] == {"concurrency": 8}
    redis_client.delete(*keys.job_keys(JOB))
    page = create_app(Source(open_store(path, readonly=True), store_shown=path)).test_client().get(f"/jobs/{JOB}")
    html = page.get_data(as_text=True)
    assert page.status_code == 200, html[:500]
    section = html[html.index('id="audit"'):]
    assert section.index("rerun") < section.index("alice") and "concurrency=8" in section
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in section
