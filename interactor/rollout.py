"""The job a feed server serves: the one it was started with, or the one a trainer's
``POST /start_rollout`` asks for (its body read here), with the producer thread of a
continuous job. The command (interactor/feedcmd.py) makes the ``Rollout`` and hands its
``from_request`` to the HTTP server (interactor/feedserve.py) as the route's ``start``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import NamedTuple

from broker import feed
from broker.duty import Duty
from broker.ledger import Ledger
from broker.settings import Settings, SettingsError

log = logging.getLogger("interactor.feed")

# The original buffer server's start_rollout keys that name its task (a dataset, an env, a group
# size). What else its body carries (remote_engine_url, sampling_params, ...) configured what it
# ran itself; our workers take that from their settings, and the answer names what was ignored.
ORIGINAL_TASK_KEYS = {"input_file": "dataset", "task_type": "env_name", "num_repeat_per_sample": "env_num"}
OUR_KEYS = ("task_files", "config", "epochs", "seed")


class RolloutRequest(NamedTuple):
    """What a ``/start_rollout`` body asks for."""

    paths: list[str]  # the task files
    epochs: int
    seed: int
    ignored: list[str]  # keys of the body that configure nothing here
    written: Path | None  # the file its inline content was written to, for this request alone


def rollout_request(body: dict, run_dir: Path, cwd: Path | None = None) -> RolloutRequest:
    """``/start_rollout``'s body as the task files it names, epochs, seed, and what is ignored. One of:

    * ``task_files``: paths of task files (as ``interactor feed serve tasks.yaml`` takes);
    * ``config``: a path, or a task file's content inline (``{environments: [...]}``);
    * the original buffer server's ``{task_type, input_file, num_repeat_per_sample}``: one
      environment ``task_type`` over the rows of ``input_file``, groups of that many.

    Relative paths are the server's working directory's. Inline content is written under the
    run folder (``written``), so the job's task file stays readable after the request; the
    caller removes it when the request is refused. Which files these may be is decided when
    they are read (``feed_task_roots``, producer/readroots.py)."""
    cwd = cwd or Path.cwd()
    epochs = body.get("epochs", 0)
    seed = body.get("seed", 0)
    for name, v in (("epochs", epochs), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise feed.FeedError(f"{name} must be an integer >= 0, got {v!r}")
    files = body.get("task_files")
    config = body.get("config")
    original = {k: body[k] for k in ORIGINAL_TASK_KEYS if k in body}
    given = [n for n, v in (("task_files", files), ("config", config), ("task_type/input_file", original)) if v]
    if len(given) != 1:
        raise feed.FeedError("start_rollout needs one of 'task_files' (task file paths), 'config' (a task file's "
                             "path or content) or the original's 'task_type' + 'input_file' + "
                             f"'num_repeat_per_sample'; got {', '.join(given) or 'none'}")
    if files is not None or isinstance(config, str):
        files = [config] if isinstance(config, str) else files
        files = [files] if isinstance(files, str) else files
        if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
            raise feed.FeedError(f"task_files must be a list of task file paths, got {files!r}")
        return RolloutRequest([str(cwd / f) for f in files], epochs, seed, _ignored(body), None)
    if original:
        missing = [k for k in ORIGINAL_TASK_KEYS if k not in original]
        if missing:
            raise feed.FeedError(f"start_rollout: the original's shape needs {', '.join(missing)} too")
        if not isinstance(original["input_file"], str) or not isinstance(original["task_type"], str):
            raise feed.FeedError("input_file and task_type must be strings")
        env = {ORIGINAL_TASK_KEYS[k]: v for k, v in original.items()}
        env["dataset"] = str(cwd / env["dataset"])
        config = {"environments": [env]}
    if not isinstance(config, dict) or not isinstance(config.get("environments"), list):
        raise feed.FeedError("config must be a task file path or a task file's content: {environments: [...]}")
    for env in config["environments"]:
        if isinstance(env, dict) and isinstance(env.get("dataset"), str) and env["dataset"].strip():
            env["dataset"] = str(cwd / env["dataset"])  # "" is no dataset, as in a task file
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"start_rollout-{int(time.time() * 1000)}.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return RolloutRequest([str(path)], epochs, seed, _ignored(body), path)


def _ignored(body: dict) -> list[str]:
    return sorted(k for k in body if k not in OUR_KEYS and k not in ORIGINAL_TASK_KEYS)


BACKFILL_S = 30.0  # how often a feed server catches up on groups the consumer did not announce


class FeedBackfill(Duty):
    """Announces settled groups the consumer did not (consumer/announce.py ``backfill``: a round
    costs one count when nothing settled since the last)."""

    name = "feed-backfill"

    def __init__(self, service, interval_s: float):
        super().__init__(interval_s)
        self.service = service

    def tick(self) -> None:
        n = self.service.backfill()
        if n:
            log.info("job %s: %d settled groups announced by the feed server's catching up", self.service.job_id, n)


class Rollout:
    """The job a feed server serves and its producer thread (continuous jobs); what
    ``/start_rollout`` starts when the server was started without one."""

    def __init__(self, client, settings: Settings, store, stop: threading.Event, preflight: bool = True):
        self.r = client
        self.settings = settings
        self.store = store
        self.stop = stop
        self.preflight = preflight
        self.thread: threading.Thread | None = None
        self.backfill: FeedBackfill | None = None
        self.ledger = Ledger.for_settings(client, settings)
        self.served: set[str] | None = None  # the queues this server's own workers serve, if it runs some

    def new_job(self, paths: list[str], epochs: int, seed: int, roots=None):
        """Create a continuous job from task files (checked, and their servers asked, first);
        ``roots`` (a ReadRoots) bounds what a request's paths may read."""
        from producer.continuous import create_continuous_job
        from producer.enqueue import plan

        planned = plan(self.settings, paths, roots=roots)  # TaskFileError / SettingsError name the fault
        unserved = sorted({e.queue for e in planned.episodes if e.queue} - (self.served or set()))
        if self.served is not None and unserved:
            raise SettingsError(f"queues {', '.join(unserved)}: no worker of this feed server serves them (its "
                                f"workers serve {', '.join(sorted(self.served))}); start it with --queues naming "
                                "them too, or leave `queue:` out of the task file")
        if self.preflight:
            from interactor.preflight import check, refusal

            problems = check(self.settings, planned.episodes)
            if problems:
                raise SettingsError(refusal(problems))
        job = create_continuous_job(self.r, self.settings, paths, epochs=epochs, seed=seed, planned=planned)
        print(f"job {job.job_id}: continuous over {', '.join(paths)}"
              + (f", {epochs} epochs" if epochs else ", without end"), flush=True)
        return self.attach(job.job_id)

    def attach(self, job_id: str):
        from interactor.feed_service import FeedService
        from producer.continuous import ContinuousProducer

        service = FeedService(self.r, self.settings, job_id, self.store)
        # Catching up runs on its own thread from the first second: the server listens at once,
        # and supervising the fleet never waits on it.
        self.backfill = FeedBackfill(service, BACKFILL_S).start()
        self.backfill.nudge()
        if service.cfg.continuous:
            producer = ContinuousProducer(self.r, self.settings, job_id)
            self.thread = threading.Thread(target=producer.run, args=(self.stop,), daemon=True, name="producer")
            self.thread.start()
        return service

    def from_request(self, body: dict):
        """``/start_rollout``: bad input is a 400 naming it, and nothing is created."""
        from producer.readroots import ReadRoots
        from producer.taskfile import TaskFileError

        inline = Path(self.settings.run_dir) / "rollouts"
        inline.mkdir(parents=True, exist_ok=True)  # a root must exist to be resolved
        roots = ReadRoots.from_setting(self.settings.feed_task_roots, default=Path.cwd(), also=[inline])
        request = rollout_request(body, inline)
        try:
            service = self.new_job(request.paths, request.epochs, request.seed, roots=roots)
        except BaseException as exc:
            # A refused request leaves nothing behind, on disk either: requests repeated by any
            # local process or trainer would otherwise fill it, a body at a time.
            if request.written is not None:
                request.written.unlink(missing_ok=True)
            if isinstance(exc, (TaskFileError, SettingsError)):
                raise feed.FeedError(f"start_rollout: {exc}") from None
            raise
        note = (f" ({', '.join(request.ignored)} ignored: the workers use their own settings)"
                if request.ignored else "")
        return service, note


def check_servable(client, settings: Settings, job_id: str) -> None:
    """``--job J``: a job that is unknown, has no feed or is finished is refused in one line
    before anything is attached (a producer started for a finished job would do nothing; a
    trainer would wait on it for ever)."""
    from broker.keys import Keys
    from broker.ledger import Ledger
    from broker.settings import redact_url

    keys = Keys(settings.key_prefix)
    ledger = Ledger.for_settings(client, settings)
    if ledger.job_spec(job_id) is None:
        raise SettingsError(f"--job {job_id}: no such job in Redis at {redact_url(settings.redis_url)} "
                            "(a finished job is forgotten once its retention passes)")
    if not feed.has_feed(client, keys, job_id):
        raise SettingsError(f"--job {job_id}: the job has no feed (only continuous jobs have one: "
                            "`interactor feed serve tasks.yaml`)")
    if feed.finished(client, keys, job_id, ledger.counts(job_id), settings.job_retention_s):
        raise SettingsError(f"--job {job_id}: the job is finished: no episode to run, no group ready or taken, "
                            "nothing left to produce (or no trainer took anything for the job retention, "
                            f"{settings.job_retention_s:g} s); start a new job from its task files")
