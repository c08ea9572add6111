"""The store's readers of jobs, episodes, groups and their steps: what ``interactor
results``, ``status``, the exports (consumer/export.py), the feed (consumer/announce.py,
interactor/feed_service.py) and the results browser's single-item pages read.

A mixin of :class:`consumer.storage.backend.ResultStore`, kept apart from the write path so
that backend.py holds the writer and its primitives only; these methods use nothing of a
backend but :meth:`~ResultStore.query`, :meth:`~ResultStore.query_dicts` and
:meth:`~ResultStore.has_table`, and the same SQL runs on SQLite and PostgreSQL (``?``
placeholders; flags tested bare or cast, see backend.py). The browser's filtered, sorted and
paged lists are in browse.py.
"""

from __future__ import annotations

from typing import Any, Sequence

import orjson

from broker import errors
from broker.states import LedgerState, Phase, StoredStatus
from consumer.storage import phases as attempt_phases_table
from consumer.storage import resumes as attempt_resumes_table
from consumer.storage import step_cached as step_cached_table
from consumer.storage import step_reasoning as step_reasoning_table
from consumer.storage import step_tokens as step_tokens_table
from consumer.storage.sqltext import chunks, marks


class StoreReads:
    """Job, episode and group readers (a mixin of ResultStore: needs its ``query``,
    ``query_dicts`` and ``has_table``)."""

    # ------------------------------------------------------------------ jobs
    def job_ids(self) -> list[str]:
        """Every job known to the store, oldest first."""
        rows = self.query(
            "SELECT job_id, MIN(t) FROM (SELECT job_id, created_at AS t FROM jobs "
            "UNION ALL SELECT job_id, started_at AS t FROM episodes) u GROUP BY job_id ORDER BY MIN(t), job_id"
        )
        return [r[0] for r in rows]

    def job(self, job_id: str) -> dict | None:
        rows = self.query("SELECT spec FROM jobs WHERE job_id = ?", (job_id,))
        return orjson.loads(rows[0][0]) if rows and rows[0][0] else None

    def jobs(self, limit: int = 100) -> list[dict]:
        """The most recent jobs with their counts: the results browser's first page."""
        out = []
        for job_id in self.job_ids()[-limit:][::-1]:
            res = self.results(job_id)
            out.append(res["job"] | {"groups": res["groups"]})
        return out

    def results(self, job_id: str) -> dict:
        """One job's summary: episodes per status, steps, rewards per env_name, groups."""
        spec = self.job(job_id) or {}
        counts = dict(self.query("SELECT status, COUNT(*) FROM episodes WHERE job_id = ? GROUP BY status", (job_id,)))
        (n_steps, n_attempts, p_tok, c_tok, first, last) = self.query(
            "SELECT COALESCE(SUM(steps), 0), COALESCE(SUM(attempts), 0), COALESCE(SUM(prompt_tokens), 0), "
            "COALESCE(SUM(completion_tokens), 0), MIN(started_at), MAX(finished_at) FROM episodes WHERE job_id = ?",
            (job_id,))[0]
        (mean_reward,) = self.query(
            f"SELECT AVG(total_reward) FROM episodes WHERE job_id = ? AND status = '{StoredStatus.COMPLETED}'", (job_id,))[0]
        (announced,) = self.query("SELECT COUNT(*) FROM job_environments WHERE job_id = ?", (job_id,))[0]
        # Why the completed episodes ended (broker.states.EndedBy): a prompt outgrowing the
        # model's context shows here as context_length.
        ended_by = {why or "unknown": int(n) for why, n in self.query(
            "SELECT ended_by, COUNT(*) FROM episodes "
            f"WHERE job_id = ? AND status = '{StoredStatus.COMPLETED}' GROUP BY ended_by "
            "ORDER BY COUNT(*) DESC, ended_by", (job_id,))}
        by_env = {}
        for env, n, comp, fail, mean, lo, hi, pt, ct in self.query(
            f"SELECT env_name, COUNT(*), SUM(CASE WHEN status = '{StoredStatus.COMPLETED}' THEN 1 ELSE 0 END), "
            f"SUM(CASE WHEN status = '{StoredStatus.FAILED}' THEN 1 ELSE 0 END), "
            f"AVG(CASE WHEN status = '{StoredStatus.COMPLETED}' THEN total_reward END), "
            f"MIN(CASE WHEN status = '{StoredStatus.COMPLETED}' THEN total_reward END), "
            f"MAX(CASE WHEN status = '{StoredStatus.COMPLETED}' THEN total_reward END), "
            "COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
            "FROM episodes WHERE job_id = ? GROUP BY env_name ORDER BY env_name",
            (job_id,),
        ):
            by_env[env] = {"episodes": n, "completed": int(comp or 0), "failed": int(fail or 0), "mean": mean,
                           "min": lo, "max": hi, "prompt_tokens": int(pt), "completion_tokens": int(ct)}
        # A group is incomplete for a dead-lettered member (incomplete_reason says which), or its
        # job was cancelled before it was through (incomplete_reason: cancelled).
        total, complete, with_failure, cancelled_groups, mean_std, zero_std = self.query(
            "SELECT COUNT(*), COALESCE(SUM(complete), 0), "
            "SUM(CASE WHEN failed > 0 THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN failed = 0 AND incomplete_reason = ? THEN 1 ELSE 0 END), "
            "AVG(CASE WHEN complete = 1 THEN reward_std END), "
            "SUM(CASE WHEN complete = 1 AND reward_std = 0 THEN 1 ELSE 0 END) FROM groups WHERE job_id = ?",
            (errors.CANCELLED, job_id),
        )[0]
        started = sum(counts.values())
        expected = spec.get("episodes")
        tokens = int(p_tok) + int(c_tok)
        span = (last - first) if first is not None and last is not None and last > first else None
        return {
            "job": {
                "job_id": job_id,
                "model": spec.get("model"),
                "created_at": spec.get("created_at"),
                "episodes_expected": expected,
                "groups_expected": spec.get("groups"),
                "episodes": started,
                "announced": int(announced),
                # not started yet: the ledger's word for it, beside the stored rows' statuses
                LedgerState.QUEUED: max(0, (expected or announced or 0) - started),
                StoredStatus.COMPLETED: counts.get(StoredStatus.COMPLETED, 0),
                StoredStatus.FAILED: counts.get(StoredStatus.FAILED, 0),
                StoredStatus.RUNNING: counts.get(StoredStatus.RUNNING, 0),
                StoredStatus.RETRYING: counts.get(StoredStatus.RETRYING, 0),
                StoredStatus.COMPLETING: counts.get(StoredStatus.COMPLETING, 0),
                StoredStatus.CANCELLED: counts.get(StoredStatus.CANCELLED, 0),
                "attempts": int(n_attempts),
                "steps": int(n_steps),
                "short_trajectories": counts.get(StoredStatus.COMPLETING, 0),
                "mean_reward": mean_reward,
                "prompt_tokens": int(p_tok),
                "completion_tokens": int(c_tok),
                "tokens_per_episode": tokens / started if started else None,
                "tokens_per_s": tokens / span if span else None,
                "ended_by": ended_by,
            },
            "by_env": by_env,
            # why episodes failed: each reason with its count and one example
            "failures": self.failure_reasons(job_id),
            # token-exact trajectories (jobs run with tokens): None when no step asked
            "token_ids": self.token_summary(job_id),
            # where the attempts' time went (attempt_phases): None when no attempt was timed
            "phases": self.phase_summary(job_id),
            # attempts that continued their predecessor's env instance, or why not: None when none had one
            "resumes": self.resume_summary(job_id),
            # completed on the first try apart from after retries, per env_name (consumer/storage/retry_split.py)
            "retries": self.retry_split(job_id),
            # tokens and cost of every stored step, the budgets and how much is used (consumer/storage/job_usage.py)
            "usage": self.job_usage(job_id, spec, counts.get(StoredStatus.CANCELLED, 0)),
            "groups": {
                "total": int(total),
                "complete": int(complete),
                "incomplete": int(total) - int(complete),
                "failed": int(with_failure or 0),
                "cancelled": int(cancelled_groups or 0),
                "mean_std": mean_std,
                "zero_std": int(zero_std or 0),
            },
        }

    def phase_summary(self, job_id: str) -> dict | None:
        """Where the job's attempts' time went (records v5, broker/records.py Phase): per phase,
        the mean seconds per attempt over the attempts that timed it, how many did, and the
        total. None when no attempt of the job was timed (older records or store)."""
        if not self.has_table(attempt_phases_table.TABLE):
            return None
        cols = attempt_phases_table.PHASE_COLUMNS
        row = self.query(
            "SELECT COUNT(*), " + ", ".join(f"AVG({c}), COUNT({c}), SUM({c})" for c in cols)
            + " FROM attempt_phases WHERE job_id = ?", (job_id,))[0]
        if not row[0]:
            return None
        out: dict[str, Any] = {"attempts": int(row[0]), "mean_s": {}, "timed": {}, "total_s": {}}
        for i, phase in enumerate(Phase):
            mean, n, total = row[1 + 3 * i: 4 + 3 * i]
            out["mean_s"][phase] = None if mean is None else float(mean)
            out["timed"][phase] = int(n)
            out["total_s"][phase] = float(total or 0.0)
        return out

    def token_summary(self, job_id: str) -> dict | None:
        """Per status, the trajectory steps that asked for tokens; steps and episodes whose
        prompt did not extend the previous turn (token_drift); ids and bytes stored. None when
        no step of the job asked."""
        if not self.has_step_tokens():
            return None
        rows = self.query(
            "SELECT t.token_status, COUNT(*), SUM(CASE WHEN t.token_drift IS NOT NULL THEN 1 ELSE 0 END), "
            "COUNT(DISTINCT CASE WHEN t.token_drift IS NOT NULL THEN t.session_id END), "
            "COALESCE(SUM(t.prompt_len), 0), COALESCE(SUM(t.completion_len), 0), "
            "COALESCE(SUM(LENGTH(t.prompt_ids)), 0) + COALESCE(SUM(LENGTH(t.completion_ids)), 0) "
            "+ COALESCE(SUM(LENGTH(t.completion_logprobs)), 0), COALESCE(SUM(LENGTH(t.completion_token_texts)), 0) "
            "FROM step_tokens t JOIN session_steps s ON s.session_id = t.session_id AND s.step_id = t.step_id "
            "AND s.attempt_id = t.attempt_id WHERE s.job_id = ? GROUP BY t.token_status", (job_id,))
        if not rows:
            return None
        out = {"steps": 0, "by_status": {}, "drift_steps": 0, "drift_episodes": 0, "prompt_ids": 0,
               "completion_ids": 0, "bytes": 0, "text_bytes": 0}
        for status, n, drift, drift_eps, p, c, nbytes, text_bytes in rows:
            out["steps"] += int(n)
            out["by_status"][status] = int(n)
            out["drift_steps"] += int(drift or 0)
            out["drift_episodes"] += int(drift_eps or 0)
            out["prompt_ids"] += int(p)
            out["completion_ids"] += int(c)
            out["bytes"] += int(nbytes)  # packed ids and logprobs
            out["text_bytes"] += int(text_bytes)  # the token strings (JSON), for readers
        return out

    # ------------------------------------------------------------------ episodes and groups
    def episode(self, episode_id: str) -> dict | None:
        rows = self.query_dicts("SELECT * FROM episodes WHERE episode_id = ?", (episode_id,))
        return rows[0] if rows else None

    def group(self, group_id: str) -> dict | None:
        rows = self.query_dicts("SELECT * FROM groups WHERE group_id = ?", (group_id,))
        return rows[0] if rows else None

    def groups(self, job_id: str) -> list[dict]:
        """Every group of a job: size, completed, failed, reward mean and std, complete or why not."""
        return sorted(self.query_dicts("SELECT * FROM groups WHERE job_id = ?", (job_id,)),
                      key=lambda g: id_order(g["group_id"]))

    def score_samples(self, job_id: str) -> list:
        """The job's episodes as score_stats reads them (one ``Sample`` each), in task-file order."""
        from consumer.storage.score_stats import Sample

        rows = self.query("SELECT group_id, env_name, status, total_reward, episode_id FROM episodes WHERE job_id = ?",
                          (job_id,))
        rows.sort(key=lambda r: (id_order(r[0] or ""), id_order(r[4])))
        return [Sample(g or e, env or "", float(reward) if status == StoredStatus.COMPLETED and reward is not None
                       else None, status == StoredStatus.FAILED) for g, env, status, reward, e in rows]

    def score_summary(self, job_id: str, threshold: float | None = None) -> dict:
        """How sure the job's scores are (consumer/storage/score_stats.py): per env_name and per
        job, mean, standard error, 95% interval, pass@1, pass@k, mean@k."""
        from consumer.storage.score_stats import DEFAULT_THRESHOLD, score_summary

        return score_summary(self.score_samples(job_id), DEFAULT_THRESHOLD if threshold is None else threshold)

    def task_table(self, job_id: str, threshold: float | None = None) -> list[dict]:
        """One row per task (group) of the job: samples, completed, solved, mean reward, solved
        always, sometimes or never, and ``task``: what it asked (its dataset row, else its
        env_params), as JSON text."""
        from consumer.storage.score_stats import DEFAULT_THRESHOLD, task_rows

        rows = task_rows(self.score_samples(job_id), DEFAULT_THRESHOLD if threshold is None else threshold)
        asked = self.tasks_asked(job_id)
        for row in rows:
            row["task"] = asked.get(row["group_id"], "")
        return rows

    def tasks_asked(self, job_id: str) -> dict[str, str]:
        """Per group (task) of the job, what it asked: its dataset row, else its env_params (JSON text)."""
        return {g: _task_text(p) for g, p in self.query(
            "SELECT group_id, MIN(env_params) FROM job_environments WHERE job_id = ? GROUP BY group_id", (job_id,))}

    def compare_jobs(self, job_a: str, job_b: str, threshold: float | None = None) -> dict:
        """Two jobs side by side (consumer/storage/compare.py): per env_name the mean rewards with
        their standard errors, the difference and whether it is more than noise, and the task rows
        one solves and the other does not."""
        from consumer.storage.compare import compare

        return compare(job_a, self.score_samples(job_a), self.tasks_asked(job_a),
                       job_b, self.score_samples(job_b), self.tasks_asked(job_b), threshold)

    def group_members(self, group_id: str) -> list[dict]:
        return self.query_dicts("SELECT * FROM episodes WHERE group_id = ? ORDER BY episode_id", (group_id,))

    def attempts(self, episode_id: str) -> list[dict]:
        """The episode's closed attempts, each with its phases' seconds (``<phase>_s``, None where
        not timed: records before v5, or a store no writer of this code has opened yet)."""
        if not self.has_table(attempt_phases_table.TABLE):
            return [d | dict.fromkeys(attempt_phases_table.PHASE_COLUMNS) for d in self.query_dicts(
                "SELECT * FROM attempts WHERE episode_id = ? ORDER BY attempt, started_at", (episode_id,))]
        cols = ", ".join(f"p.{c}" for c in attempt_phases_table.PHASE_COLUMNS)
        rows = self.query_dicts(
            f"SELECT a.*, {cols} FROM attempts a LEFT JOIN attempt_phases p ON p.episode_id = a.episode_id "
            "AND p.attempt_id = a.attempt_id WHERE a.episode_id = ? ORDER BY a.attempt, a.started_at", (episode_id,))
        resumes = {}
        if self.has_table(attempt_resumes_table.TABLE):
            resumes = {d["attempt_id"]: d for d in self.query_dicts(
                "SELECT attempt_id, trajectory, resumed_at, resume_note FROM attempt_resumes WHERE episode_id = ?",
                (episode_id,))}
        for d in rows:  # resumed at step k, or why not (consumer/storage/resumes.py)
            r = resumes.get(d["attempt_id"], {})
            d.update(trajectory=r.get("trajectory"), resumed_at=r.get("resumed_at"), resume_note=r.get("resume_note"))
        return rows

    def episode_trajectory(self, episode_id: str) -> list[dict]:
        """The episode's trajectory (its session_steps rows) in step order, JSON decoded, each
        with its answer's ``reasoning_content`` (None: it had none; consumer/storage/step_reasoning.py)
        and ``cached``: whether the response cache answered it (consumer/storage/step_cached.py)."""
        steps = [_decode_step(d) for d in self.query_dicts(
            "SELECT * FROM session_steps WHERE session_id = ? ORDER BY step_id", (episode_id,))]
        reasoning = {}
        if steps and self.has_table(step_reasoning_table.TABLE):
            reasoning = {(a, n): text for a, n, text in self.query(
                f"SELECT attempt_id, step_id, reasoning_content FROM {step_reasoning_table.TABLE} "
                "WHERE session_id = ?", (episode_id,))}
        cached = set()
        if steps and self.has_table(step_cached_table.TABLE):
            cached = set(self.query(f"SELECT attempt_id, step_id FROM {step_cached_table.TABLE} WHERE session_id = ?",
                                    (episode_id,)))
        for d in steps:
            d["reasoning_content"] = reasoning.get((d.get("attempt_id"), d.get("step_id")))
            d["cached"] = (d.get("attempt_id"), d.get("step_id")) in cached
        return steps

    def superseded_steps(self, episode_id: str) -> list[dict]:
        """Rows of the episode's other attempts, with why they are not its trajectory."""
        return [_decode_step(d) for d in self.query_dicts(
            "SELECT * FROM superseded_steps WHERE session_id = ? ORDER BY attempt, attempt_id, step_id",
            (episode_id,))]

    def job_environments(self, job_id: str) -> list[dict]:
        return self.query_dicts("SELECT * FROM job_environments WHERE job_id = ? ORDER BY id", (job_id,))

    def completing(self, limit: int = 1000) -> list[tuple[str, str, str, str]]:
        """Completions still waiting for steps: (episode, job, attempt_id, close entry id)."""
        return [tuple(r) for r in self.query(
            "SELECT episode_id, job_id, completed_attempt_id, close_entry FROM episodes "
            f"WHERE status = '{StoredStatus.COMPLETING}' "
            "ORDER BY updated_at LIMIT ?", (limit,))]

    def job_environment(self, env_id: str) -> dict | None:
        """The episode as it was announced: its env_params (the task), group and env_name."""
        rows = self.query_dicts("SELECT * FROM job_environments WHERE env_id = ?", (env_id,))
        return rows[0] if rows else None

    # ------------------------------------------------------------------ exports and the feed
    def export_episodes(self, job_id: str, *, statuses: Sequence[str] | None, env_names: Sequence[str] | None,
                        complete_groups_only: bool) -> list[tuple]:
        """(episode, attempt_id, status, total reward, group complete, group id, group size) in
        group order: what an export walks."""
        where, args = ["e.job_id = ?"], [job_id]
        if statuses is not None:
            where.append(f"e.status IN ({marks(statuses)})")
            args.extend(statuses)
        if env_names:
            where.append(f"e.env_name IN ({marks(env_names)})")
            args.extend(env_names)
        if complete_groups_only:
            where.append("g.complete = 1")
        return self.query(
            "SELECT e.episode_id, e.attempt_id, e.status, e.total_reward, COALESCE(g.complete, 0), e.group_id, "
            "COALESCE(g.size, 0) FROM episodes e LEFT JOIN groups g ON g.group_id = e.group_id "
            f"WHERE {' AND '.join(where)} ORDER BY e.group_id, e.episode_id", args)

    def export_steps(self, episode_id: str, *, trainable_only: bool) -> list[tuple]:
        """The episode's trajectory rows as an export needs them, in step order. (The flag is
        cast: a reader may meet a PostgreSQL store no writer has migrated yet, flags SMALLINT.)"""
        return self.query(
            "SELECT job_id, session_id, group_id, env_name, step_id, attempt, messages, response, step_reward, "
            "weight_version, is_trainable, is_terminal, is_truncated, prompt_tokens, completion_tokens, ended_by "
            "FROM session_steps WHERE session_id = ?"
            + (" AND CAST(is_trainable AS INTEGER) = 1" if trainable_only else "")
            + " ORDER BY step_id", (episode_id,))

    def weight_versions(self, job_id: str) -> list[tuple[str, Any]]:
        """(episode, weight_version) pairs of the job's trajectories (staleness filters)."""
        return self.query(
            "SELECT session_id, weight_version FROM session_steps WHERE job_id = ? AND weight_version IS NOT NULL "
            "GROUP BY session_id, weight_version", (job_id,))

    def feed_groups(self, group_ids: Sequence[str]) -> dict[str, dict]:
        """What the feed announces of each group (consumer/announce.py): its row of ``groups``, its
        members (episode_id, status, total_reward, reason) and the weight versions of its
        trajectories' steps."""
        out: dict[str, dict] = {}
        for chunk in chunks(list(group_ids)):
            for d in self.query_dicts(
                    "SELECT group_id, job_id, size, completed, failed, complete, incomplete_reason FROM groups "
                    f"WHERE group_id IN ({marks(chunk)})", chunk):
                out[d["group_id"]] = d | {"members": [], "versions": []}
            for gid, ep, st, tr, reason in self.query(
                    "SELECT group_id, episode_id, status, total_reward, reason FROM episodes "
                    f"WHERE group_id IN ({marks(chunk)}) ORDER BY group_id, episode_id", chunk):
                if gid in out:
                    out[gid]["members"].append((ep, st, float(tr or 0.0), reason))
            for gid, wv in self.query(
                    "SELECT DISTINCT group_id, weight_version FROM session_steps "
                    f"WHERE group_id IN ({marks(chunk)}) AND weight_version IS NOT NULL", chunk):
                if gid in out:
                    out[gid]["versions"].append(wv)
        return out

    def feed_steps(self, episode_id: str) -> list[tuple]:
        """The episode's trajectory rows as the feed hands them to a trainer, in step order."""
        return self.query(
            "SELECT job_id, session_id, group_id, env_name, step_id, attempt, messages, response, step_reward, "
            "weight_version, CAST(is_trainable AS INTEGER), CAST(is_terminal AS INTEGER), "
            "CAST(is_truncated AS INTEGER), prompt_tokens, completion_tokens, ended_by, finish_reason, created_ts "
            "FROM session_steps WHERE session_id = ? ORDER BY step_id", (episode_id,))

    def resume_summary(self, job_id: str) -> dict | None:
        """Resumed attempts, the steps they did not run again, and the attempts that started
        afresh though they had a predecessor, by why (consumer/storage/resumes.py)."""
        if not self.has_table(attempt_resumes_table.TABLE):
            return None
        rows = self.query("SELECT resumed_at, resume_note FROM attempt_resumes WHERE job_id = ?", (job_id,))
        if not rows:
            return None
        resumed = [int(r) for r, _ in rows if r]
        fallbacks: dict[str, int] = {}
        for r, note in rows:
            if not r and note:
                fallbacks[note] = fallbacks.get(note, 0) + 1
        return {"resumed": len(resumed), "steps_saved": sum(r - 1 for r in resumed), "fallbacks": fallbacks}

    def job_usage(self, job_id: str, spec: dict | None = None, cancelled: int = 0) -> dict:
        """The job's tokens and cost over all its stored steps, with its budgets (consumer/storage/job_usage.py)."""
        from consumer.storage import job_usage, step_cached

        row = self.query(job_usage.sql(self.has_table(step_cached.TABLE)), (job_id, job_id))[0]
        return job_usage.usage(row, spec if spec is not None else self.job(job_id), cancelled)

    def retry_split(self, job_id: str) -> dict:
        """The job's completed episodes that completed on their first try apart from those that
        needed retries, per env_name, and its failed ones (consumer/storage/retry_split.py)."""
        from consumer.storage import retry_split

        failed = dict(self.query(retry_split.FAILED_SQL, (job_id,)))
        return retry_split.split(self.query(retry_split.SQL, retry_split.args(job_id)), failed)

    def failure_reasons(self, job_id: str) -> list[dict]:
        """The reasons the job's failed episodes failed for, most frequent first: each with its
        count and one episode and error message as an example."""
        out = []
        for reason, n, example in self.query(
                "SELECT COALESCE(reason, ''), COUNT(*), MIN(episode_id) FROM episodes "
                f"WHERE job_id = ? AND status = '{StoredStatus.FAILED}' GROUP BY COALESCE(reason, '') "
                "ORDER BY COUNT(*) DESC, 1", (job_id,)):
            error = self.query("SELECT error FROM episodes WHERE episode_id = ?", (example,))
            out.append({"reason": reason or "unknown", "count": int(n), "episode_id": example,
                        "error": (error[0][0] if error else None) or ""})
        return out

    def settled_group_count(self, job_id: str) -> int:
        """How many groups of a job have no member left to run: a feed's catching up
        (consumer/announce.py) reads the ids only when this moved."""
        rows = self.query("SELECT COUNT(*) FROM groups WHERE job_id = ? AND size > 0 AND completed + failed >= size",
                          (job_id,))
        return int(rows[0][0]) if rows else 0

    def settled_group_ids(self, job_id: str) -> list[str]:
        """Groups of a job with no member left to run (every one completed or failed): what a
        feed attached late, or a consumer that crashed between commit and announce, catches up on."""
        return [r[0] for r in self.query(
            "SELECT group_id FROM groups WHERE job_id = ? AND size > 0 AND completed + failed >= size", (job_id,))]

    # ------------------------------------------------------------------ tokens (step_tokens)
    def has_step_tokens(self) -> bool:
        """Whether the store has the step_tokens table (a store made before it has not)."""
        return self.has_table(step_tokens_table.TABLE)

    def episode_tokens(self, episode_id: str, step_id: int | None = None) -> list[dict]:
        """The token rows of the episode's trajectory (the attempt its session_steps rows are
        of), in step order, ids and logprobs decoded (consumer/storage/step_tokens.py)."""
        if not self.has_step_tokens():
            return []
        sql = ("SELECT t.* FROM step_tokens t JOIN session_steps s ON s.session_id = t.session_id "
               "AND s.step_id = t.step_id AND s.attempt_id = t.attempt_id WHERE s.session_id = ?")
        args: list[Any] = [episode_id]
        if step_id is not None:
            sql += " AND s.step_id = ?"
            args.append(int(step_id))
        return [step_tokens_table.decode_row(d) for d in self.query_dicts(sql + " ORDER BY t.step_id", args)]

    def episode_token_index(self, episode_id: str) -> dict[int, dict]:
        """step_id -> status, source, error, drift and lengths of the trajectory's token rows,
        without the ids (the results browser's episode page)."""
        if not self.has_step_tokens():
            return {}
        return {d["step_id"]: d for d in self.query_dicts(
            "SELECT t.step_id, t.token_status, t.token_source, t.token_error, t.token_drift, t.prompt_len, "
            "t.completion_len FROM step_tokens t JOIN session_steps s ON s.session_id = t.session_id "
            "AND s.step_id = t.step_id AND s.attempt_id = t.attempt_id WHERE s.session_id = ? ORDER BY t.step_id",
            (episode_id,))}

    def sql(self, text: str, args: Sequence[Any] = ()) -> list[tuple]:
        """A read-only query for tests and tools that check the original tables' contract."""
        return self.query(text, args)


def _decode_step(d: dict) -> dict:
    """A step row as readers use it: its JSON columns decoded, its flags as booleans (0/1 in
    SQLite and in a PostgreSQL store no writer has migrated yet)."""
    if d.get("messages") is not None:
        d["messages"] = orjson.loads(d["messages"])
    if d.get("env_state") is not None:
        d["env_state"] = orjson.loads(d["env_state"])
    for k in ("is_terminal", "is_truncated", "is_session_completed", "is_trainable"):
        if k in d and d[k] is not None:
            d[k] = bool(d[k])
    return d


def _task_text(env_params: str | None) -> str:
    """What a task asked, as compact JSON: its dataset row, or its env_params without one."""
    if not env_params:
        return ""
    try:
        params = orjson.loads(env_params)
    except orjson.JSONDecodeError:
        return str(env_params)
    row = params.get("dataset") if isinstance(params, dict) else None
    return orjson.dumps(row if row else params).decode()


def id_order(dotted_id: str) -> tuple:
    """Sort key of a dotted id (``{job}.{file}.{entry}.{row}``): numeric parts as numbers, so
    that group ``….1.2.2`` comes before ``….1.2.10``, as the task file has them."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in dotted_id.split("."))
