"""The results browser's compare page: two jobs side by side (consumer/storage/compare.py), as
``interactor compare A B`` prints them."""

from __future__ import annotations

from flask import Flask, abort, render_template, request

from interactor.ui.job_pages import MAX_JOB_ID_CHARS
from interactor.ui.source import AGGREGATE_TTL_S, Source

ROWS_SHOWN = 200  # of each side's rows solved by one job only; the rest counted


def register(app: Flask, source: Source) -> None:
    @app.get("/compare")
    def compare():
        a, b = request.args.get("a", ""), request.args.get("b", "")
        threshold = request.args.get("threshold", "")
        if len(a) > MAX_JOB_ID_CHARS or len(b) > MAX_JOB_ID_CHARS:
            abort(400, f"job ids of at most {MAX_JOB_ID_CHARS} characters")
        try:
            x = float(threshold) if threshold else None
        except ValueError:
            abort(400, "threshold must be a number")
        ids = source.job_ids()
        res = None
        if a and b:
            missing = [j for j in (a, b) if j not in ids]
            if missing:
                abort(404, f"no job {', '.join(map(repr, missing))} in {source.store_shown}")
            # an active job's numbers move: read them as often as its job page does
            active = any(p["active"] for p in source.progress([a, b]))
            res = source.compare(a, b, x, ttl_s=AGGREGATE_TTL_S[active])
        return render_template("compare.html", ids=ids, a=a, b=b, threshold=threshold, res=res,
                               rows_shown=ROWS_SHOWN)
