"""The results browser's dead letters: the list (from Redis, or what the store knows of failed
episodes without it) and the one action, re-driving them (behind the action guard)."""

from __future__ import annotations

import logging
from urllib.parse import urlencode

from flask import Flask, abort, redirect, render_template, request, url_for

from broker.states import StoredStatus
from interactor.ui.safety import browser_who, check_action
from interactor.ui.source import Source

log = logging.getLogger("interactor.ui")

MAX_LETTERS_SHOWN = 1000


def register(app: Flask, source: Source) -> None:
    @app.get("/dead-letters")
    def dead_letters():
        job_id = request.args.get("job") or None
        reason = request.args.get("reason") or None
        got = source.dead_letters(job_id, reason, limit=MAX_LETTERS_SHOWN)
        failed = None
        if got is None:  # no Redis: what the store knows of failed episodes
            failed = [(j, source.count_episodes(j, statuses=[StoredStatus.FAILED])) for j in source.job_ids()]
            failed = [(j, n) for j, n in failed if n]
        letters, matched, complete = got or ([], 0, True)
        reasons: dict[str, int] = {}
        for d in letters:
            reasons[d.reason] = reasons.get(d.reason, 0) + 1
        if reason and reason not in reasons:
            reasons[reason] = 0
        return render_template("dead_letters.html", letters=letters, n_letters=matched, complete=complete,
                               redis=got is not None, failed=failed,
                               job_id=job_id, reason=reason, reasons=reasons,
                               redrove=request.args.get("redrove"), tab="dead")

    @app.post("/dead-letters/redrive")
    def redrive():
        check_action(app)
        if source.live is None:
            abort(409, "no Redis: start interactor ui with REDIS_URL (or --redis-url) to re-drive")
        ids = [i for i in request.form.getlist("episode_id") if i]
        if not ids:
            abort(400, "no episode_id given")
        sent = source.redrive(ids, who=browser_who())
        log.info("re-drove %d dead letters from the results browser: %s", len(sent), " ".join(sent[:20]))
        back = {"redrove": str(len(sent))}
        if request.form.get("job"):
            back["job"] = request.form["job"]
        return redirect(url_for("dead_letters") + "?" + urlencode(back), code=303)
