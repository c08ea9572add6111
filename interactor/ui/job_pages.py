"""The results browser's job pages: the jobs list, one job's overview, and the JSON of their
progress that the jobs pages poll."""

from __future__ import annotations

import math
import time

from flask import Flask, abort, jsonify, render_template, request

from broker.states import LedgerState
from interactor.ui import plots
from interactor.ui.source import AGGREGATE_TTL_S, MAX_JOBS, Source

MAX_JOB_ID_CHARS = 200  # /api/jobs?job=...: each id is a Redis read; longer is not an id of ours


def register(app: Flask, source: Source) -> None:
    @app.get("/")
    def jobs():
        ids = source.job_ids()
        return render_template("jobs.html", jobs=source.progress(ids), fleet=source.fleet())

    @app.get("/api/jobs")
    def api_jobs():
        asked = request.args.getlist("job")
        if len(asked) > MAX_JOBS or any(len(j) > MAX_JOB_ID_CHARS for j in asked):
            abort(400, f"at most {MAX_JOBS} job ids of at most {MAX_JOB_ID_CHARS} characters")
        ids = asked or source.job_ids()
        return jsonify({"jobs": [_jsonable(p) for p in source.progress(ids)], "fleet": source.fleet(),
                        "time": time.time()})

    @app.get("/jobs/<job_id>")
    def job(job_id: str):
        (progress,) = source.progress([job_id])
        ttl = AGGREGATE_TTL_S[progress["active"]]
        res = source.results(job_id, ttl_s=ttl)
        scores = source.scores(job_id, ttl_s=ttl)
        spec = source.job(job_id)
        if spec is None and not res["job"]["episodes"] and progress["counts_from"] == "store":
            abort(404, f"no job {job_id!r} in {source.store_shown}")
        points = source.reward_points(job_id, ttl_s=ttl)
        by_env: dict[str, list[float]] = {}
        for env, reward, _ in points:
            by_env.setdefault(env, []).append(reward)
        facets = source.episode_facets(job_id, ttl_s=ttl)
        return render_template(
            "job.html", job_id=job_id, res=res, scores=scores, p=progress, spec=spec or {},
            facets=facets, reasons={k: n for k, n in facets["reason"].items() if k},
            dist=plots.reward_distribution(by_env),
            trend=plots.reward_over_time(points),
            letters=progress[LedgerState.FAILED] if progress["counts_from"] == "redis" else None, tab="overview",
            feed=source.feed(job_id), audit=source.audit(job_id), caps=source.model_caps(job_id))

    @app.get("/api/jobs/<job_id>")
    def api_job(job_id: str):
        (progress,) = source.progress([job_id])
        return jsonify(_jsonable(progress))


def _jsonable(p: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in p.items()}
