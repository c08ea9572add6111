"""The results browser's routes (Flask): server-rendered pages, a JSON route the jobs pages
poll, and one action (re-drive dead letters) that is off unless asked for.

Why Flask: the codebase is synchronous (threads, gevent in workers, no asyncio), and the
browser is a handful of read-mostly pages over the store's reader methods. Flask is small,
long maintained (Pallets), WSGI like the rest of our Python stack, and brings Jinja2, whose
autoescaping is what makes untrusted transcripts safe to show. Its server (Werkzeug, threaded)
is plenty for the few people who browse one store; nothing else is needed.

Safety, because transcripts are untrusted text and the server may run next to a fleet:

* Everything shown is escaped by Jinja2 (``.html`` templates autoescape; no ``|safe`` on
  data); plots are SVG built with escaped labels. A Content-Security-Policy allows scripts
  and styles from this server's own files only, images also from ``data:``, so even markup
  that slipped through could not run or load anything.
* Requests must name this server in their Host header (a loopback name or the address it
  listens on): a web page cannot read the browser's pages through DNS rebinding.
* Actions change state (``POST`` only) and need ``--allow-actions`` and the token the command
  printed, sent in the form; a request from another site cannot know it, and one whose Origin
  or Sec-Fetch-Site says it is cross-site is refused before the token is even looked at.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from flask import Flask, abort, jsonify, redirect, render_template, request, url_for

from broker.states import LedgerState, Phase, StoredStatus
from consumer.storage import group_stats
from interactor.ui import plots, transcript
from interactor.ui.source import AGGREGATE_TTL_S, MAX_JOBS, Source

log = logging.getLogger("interactor.ui")

HERE = Path(__file__).resolve().parent
PAGE_SIZES = (25, 50, 100, 200, 500)
DEFAULT_PAGE = 50
MAX_LETTERS_SHOWN = 1000
MAX_JOB_ID_CHARS = 200  # /api/jobs?job=...: each id is a Redis read; longer is not an id of ours
# A step's full prompt is folded into the episode page up to this many messages; longer ones
# (full-history prompts, message_cut 0) get a page of their own, or a long episode's page
# would repeat its whole conversation once per step.
INLINE_PROMPT_MAX = 16

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def create_app(source: Source, *, allow_actions: bool = False, token: str = "",
               allowed_hosts: set[str] | None = None) -> Flask:
    """The browser over ``source``. ``allowed_hosts``: Host header values accepted (None:
    any, for a server bound to every interface that its users reach by whatever name)."""
    if allow_actions and len(token) < 16:
        raise ValueError("actions need a token of at least 16 characters")
    app = Flask("interactor.ui", template_folder=str(HERE / "templates"), static_folder=str(HERE / "static"))
    app.config.update(source=source, allow_actions=allow_actions, token=token)
    app.jinja_env.autoescape = True  # every template, whatever its name
    app.jinja_env.globals.update(url_with=url_with, fmt=fmt, fmt_time=fmt_time, fmt_dur=fmt_dur, fmt_int=fmt_int,
                                 advantage=advantage, allow_actions=allow_actions, page_sizes=PAGE_SIZES,
                                 sort_link=sort_link, inline_prompt_max=INLINE_PROMPT_MAX)

    @app.before_request
    def check_host():
        if allowed_hosts is not None and request.host.lower() not in allowed_hosts:
            abort(421, "this server answers only to its own address (DNS rebinding protection)")

    @app.after_request
    def headers(resp):
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        # Not no-referrer: under it browsers send "Origin: null" with our own form posts, which
        # the action guard must refuse; same-origin sends nothing to other sites either way.
        resp.headers["Referrer-Policy"] = "same-origin"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers.setdefault("Cache-Control", "no-store")
        return resp

    @app.context_processor
    def common():
        live = source.live
        return {"store_shown": source.store_shown, "live": live,
                "redis_error": live.error if live is not None else ""}

    @app.errorhandler(Exception)
    def failed(exc):
        from werkzeug.exceptions import HTTPException

        if isinstance(exc, HTTPException):
            return render_template("error.html", code=exc.code, message=exc.description), exc.code
        log.exception("page %s failed", request.path)
        return render_template("error.html", code=500,
                               message=f"{type(exc).__name__} while reading the results (see the server's log)"), 500

    # --- jobs -------------------------------------------------------------------------
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
        spec = source.job(job_id)
        if spec is None and not res["job"]["episodes"] and progress["counts_from"] == "store":
            abort(404, f"no job {job_id!r} in {source.store_shown}")
        points = source.reward_points(job_id, ttl_s=ttl)
        by_env: dict[str, list[float]] = {}
        for env, reward, _ in points:
            by_env.setdefault(env, []).append(reward)
        facets = source.episode_facets(job_id, ttl_s=ttl)
        return render_template(
            "job.html", job_id=job_id, res=res, p=progress, spec=spec or {},
            facets=facets, reasons={k: n for k, n in facets["reason"].items() if k},
            dist=plots.reward_distribution(by_env),
            trend=plots.reward_over_time(points),
            letters=progress[LedgerState.FAILED] if progress["counts_from"] == "redis" else None, tab="overview",
            feed=source.feed(job_id))

    @app.get("/jobs/<job_id>/episodes")
    def episodes(job_id: str):
        store = source.store
        filters = episode_filters(request.args)
        sort = request.args.get("sort", "episode_id")
        if sort not in store.EPISODE_SORTS:
            abort(400, f"unknown sort {sort!r}")
        page = keyset_page(lambda **kw: source.page_episodes(job_id, sort=sort, **filters, **kw),
                           sort_col=store.EPISODE_SORTS[sort], id_col="episode_id",
                           cast=store.EPISODE_SORT_TYPES[sort])
        (progress,) = source.progress([job_id])
        return render_template(
            "episodes.html", job_id=job_id, p=progress, page=page, sort=sort, filters=filters,
            total=source.count_episodes(job_id, **filters),
            facets=source.episode_facets(job_id, ttl_s=AGGREGATE_TTL_S[progress["active"]]),
            indexed=sort in store.INDEXED_EPISODE_SORTS, tab="episodes")

    @app.get("/jobs/<job_id>/groups")
    def groups(job_id: str):
        store = source.store
        filters = group_filters(request.args)
        sort = request.args.get("sort", "group_id")
        if sort not in store.GROUP_SORTS:
            abort(400, f"unknown sort {sort!r}")
        page = keyset_page(lambda **kw: source.page_groups(job_id, sort=sort, **filters, **kw),
                           sort_col=store.GROUP_SORTS[sort], id_col="group_id", cast=store.GROUP_SORT_TYPES[sort])
        members = source.group_members_many([g["group_id"] for g in page["rows"]])
        (progress,) = source.progress([job_id])
        return render_template(
            "groups.html", job_id=job_id, p=progress, page=page, sort=sort, filters=filters, members=members,
            total=source.count_groups(job_id, **filters),
            env_names=source.env_names(job_id), tab="groups")

    @app.get("/api/jobs/<job_id>")
    def api_job(job_id: str):
        (progress,) = source.progress([job_id])
        return jsonify(_jsonable(progress))

    # --- one group, one episode ---------------------------------------------------------
    @app.get("/groups/<group_id>")
    def group(group_id: str):
        g = source.group(group_id)
        members = source.group_members(group_id)
        if g is None and not members:
            abort(404, f"no group {group_id!r}")
        chats = {m["episode_id"]: transcript.chat(source.episode_trajectory(m["episode_id"]))
                 for m in members}
        shared = shared_opening([c for c in chats.values() if c])
        return render_template("group.html", g=g or {"group_id": group_id}, members=members, chats=chats,
                               shared=shared, job_id=(g or members[0])["job_id"])

    @app.get("/episodes/<episode_id>")
    def episode(episode_id: str):
        ep = source.episode(episode_id)
        if ep is None:
            abort(404, f"no episode {episode_id!r} in {source.store_shown}")
        steps = source.episode_trajectory(episode_id)
        g = source.group(ep["group_id"]) if ep.get("group_id") else None
        members = source.group_members(ep["group_id"]) if ep.get("group_id") else []
        superseded: dict[str, dict] = {}
        for row in source.superseded_steps(episode_id):
            s = superseded.setdefault(row["attempt_id"], {"attempt": row["attempt"], "reason": row.get(
                "superseded_reason"), "steps": []})
            s["steps"].append(row)
        task = source.job_environment(episode_id)
        letter = source.dead_letter(episode_id, ep["job_id"]) if ep["status"] == StoredStatus.FAILED else None
        attempts = source.attempts(episode_id)
        for a in attempts:  # where each attempt's time went, in Phase order (records v5)
            a["phases"] = [(p, a[f"{p}_s"]) for p in Phase if a.get(f"{p}_s") is not None]
        return render_template(
            "episode.html", ep=ep, chat=transcript.chat(steps), attempts=attempts,
            g=g, members=members, superseded=superseded, task=task, letter=letter, job_id=ep["job_id"],
            params=_pretty_json(task.get("env_params")) if task else "",
            tokens_by_step=source.episode_token_index(episode_id))

    @app.get("/episodes/<episode_id>/steps/<int:step_id>/tokens")
    def step_tokens(episode_id: str, step_id: int):
        """A step's tokens, on demand: the prompt's ids (mask 0: the env's and the template's),
        the completion's ids with their text and logprob (mask 1), and where the episode's
        token stream stands at this step (consumer/streams.py)."""
        from consumer.streams import build

        rows = source.episode_tokens(episode_id)
        row = next((r for r in rows if r["step_id"] == step_id), None)
        if row is None:
            abort(404, f"no tokens stored for step {step_id} of {episode_id!r} (was the job run with --tokens?)")
        stream = build(rows)
        segment = next((k for k, seg in enumerate(stream.segments) if step_id in seg.steps), None)
        # text of a prompt id where the stream knows it: an earlier turn's sampled token
        known: dict[int, str] = {}
        prev = [r for r in rows if r["step_id"] < step_id and r.get("completion_ids") and r.get("prompt_ids")
                and r.get("completion_token_texts")]
        for r in prev:
            start = len(r["prompt_ids"])
            for i, text in enumerate(r["completion_token_texts"]):
                known[start + i] = text
        # past a drift, positions no longer line up with the earlier turns' ids
        limit = row["token_drift"] if row.get("token_drift") is not None else math.inf
        prompt = [{"id": t, "text": known.get(i) if i < limit else None, "pos": i}
                  for i, t in enumerate(row.get("prompt_ids") or [])]
        texts = row.get("completion_token_texts") or []
        ids = row.get("completion_ids") or []
        lps = row.get("completion_logprobs") or []
        n = max(len(ids), len(texts), len(lps))
        completion = [{"id": ids[i] if i < len(ids) else None, "text": texts[i] if i < len(texts) else None,
                       "logprob": lps[i] if i < len(lps) else None,
                       "p": math.exp(lps[i]) if i < len(lps) else None} for i in range(n)]
        return render_template("tokens.html", episode_id=episode_id, row=row, prompt=prompt, completion=completion,
                               stream=stream, segment=segment, drift_at=row.get("token_drift"))

    @app.get("/episodes/<episode_id>/steps/<int:step_id>/prompt")
    def step_prompt(episode_id: str, step_id: int):
        steps = source.episode_trajectory(episode_id)
        row = next((r for r in steps if r["step_id"] == step_id), None)
        if row is None:
            abort(404, f"no step {step_id} in the trajectory of {episode_id!r}")
        view = transcript.chat([row])[0]
        return render_template("prompt.html", episode_id=episode_id, row=row, prompt=view.prompt,
                               answer=view.answer, flags=view.flags)

    # --- dead letters -------------------------------------------------------------------
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
        sent = source.redrive(ids)
        log.info("re-drove %d dead letters from the results browser: %s", len(sent), " ".join(sent[:20]))
        back = {"redrove": str(len(sent))}
        if request.form.get("job"):
            back["job"] = request.form["job"]
        return redirect(url_for("dead_letters") + "?" + urlencode(back), code=303)

    return app


# --- actions ------------------------------------------------------------------------------
def check_action(app: Flask) -> None:
    """A state-changing request: allowed by the command line, same-origin, with the token."""
    if not app.config["allow_actions"]:
        abort(403, "actions are off: start `interactor ui --allow-actions` (it prints the token they need)")
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none"):
        abort(403, "cross-site request refused")
    origin = request.headers.get("Origin")
    if origin is not None and origin != request.host_url.rstrip("/"):
        abort(403, "cross-origin request refused")
    given = request.form.get("token", "")
    if not hmac.compare_digest(given.encode(), app.config["token"].encode()):
        abort(403, "wrong or missing action token (the one `interactor ui --allow-actions` printed)")


# --- request parsing ----------------------------------------------------------------------
def _float(args, name: str) -> float | None:
    raw = args.get(name, "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        abort(400, f"{name} must be a number")
    if not math.isfinite(v):
        abort(400, f"{name} must be finite")
    return v


def episode_filters(args) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.getlist("env"):
        out["env_names"] = [e for e in args.getlist("env") if e]
    if args.getlist("status"):
        out["statuses"] = [s for s in args.getlist("status") if s]
    for key, name in (("reward_min", "rmin"), ("reward_max", "rmax")):
        v = _float(args, name)
        if v is not None:
            out[key] = v
    if args.get("reason"):
        out["reason"] = args["reason"]
    if args.get("attempts", "").strip():
        try:
            out["attempts_min"] = int(args["attempts"])
        except ValueError:
            abort(400, "attempts must be an integer")
    if args.get("group"):
        out["group_id"] = args["group"]
    return {k: v for k, v in out.items() if v not in (None, [], "")}


def group_filters(args) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.getlist("env"):
        out["env_names"] = [e for e in args.getlist("env") if e]
    if args.get("complete") in ("yes", "no"):
        out["complete"] = args["complete"] == "yes"
    if args.get("zero_std"):
        out["zero_std"] = True
    return {k: v for k, v in out.items() if v not in (None, [], "")}


def _cursor(args, which: str, cast) -> tuple[Any, str] | None:
    if which not in args:
        return None
    try:
        value = json.loads(args[which])
        if value is not None:
            value = cast(value)
    except (ValueError, TypeError):
        abort(400, f"bad {which} cursor")
    return value, args.get(which + "_id", "")


def keyset_page(fetch, *, sort_col: str, id_col: str, cast) -> dict:
    """One page and the links around it: ``after`` (next), ``before`` (previous) and
    ``page=last`` are keyset cursors, so every page is one indexed range read."""
    args = request.args
    descending = args.get("desc") == "1"
    try:
        limit = int(args.get("limit", DEFAULT_PAGE))
    except ValueError:
        abort(400, "limit must be an integer")
    limit = max(1, min(limit, PAGE_SIZES[-1]))
    before = _cursor(args, "before", cast)
    after = _cursor(args, "after", cast)
    if before is not None or args.get("page") == "last":
        rows = fetch(descending=not descending, after=before, limit=limit + 1)
        has_prev = len(rows) > limit
        rows = rows[:limit][::-1]
        has_next = before is not None
    else:
        rows = fetch(descending=descending, after=after, limit=limit + 1)
        has_next = len(rows) > limit
        rows = rows[:limit]
        has_prev = after is not None

    def key(row: dict) -> dict[str, str]:
        return {"value": json.dumps(row[sort_col]), "id": row[id_col]}

    links = {"first": url_with(after=None, after_id=None, before=None, before_id=None, page=None) if has_prev else None,
             "last": url_with(after=None, after_id=None, before=None, before_id=None, page="last") if has_next else None,
             "prev": None, "next": None}
    if rows and has_prev:
        k = key(rows[0])
        links["prev"] = url_with(before=k["value"], before_id=k["id"], after=None, after_id=None, page=None)
    if rows and has_next:
        k = key(rows[-1])
        links["next"] = url_with(after=k["value"], after_id=k["id"], before=None, before_id=None, page=None)
    return {"rows": rows, "links": links, "limit": limit, "descending": descending}


def url_with(**changes: Any) -> str:
    """This page's URL with some query parameters changed (None removes one; a list repeats it)."""
    pairs = [(k, v) for k, v in request.args.items(multi=True) if k not in changes]
    for k, v in changes.items():
        if v is None:
            continue
        for item in (v if isinstance(v, (list, tuple)) else [v]):
            pairs.append((k, str(item)))
    return request.path + ("?" + urlencode(pairs) if pairs else "")


def sort_link(sort: str, current: str, descending: bool) -> str:
    return url_with(sort=sort, desc="0" if (sort == current and descending) else ("1" if sort == current else None),
                    after=None, after_id=None, before=None, before_id=None, page=None)


# --- formatting ---------------------------------------------------------------------------
def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{nd}f}"
    return str(x)


def fmt_int(x: Any) -> str:
    return "-" if x is None else f"{int(x):,}"


def fmt_time(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def fmt_dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def advantage(reward: float | None, group: dict | None) -> float | None:
    """A member's advantage from its group's stored mean and std, with the export's default
    epsilon; None when the group has no completed member yet."""
    if reward is None or not group or group.get("reward_mean") is None:
        return None
    return group_stats.advantage(float(reward), group["reward_mean"], group.get("reward_std"))


def shared_opening(chats: list[list[transcript.StepView]]) -> list[transcript.Message]:
    """The first step's messages when every member of a group was shown the same ones (the
    task, sampled several times): shown once above the side-by-side columns."""
    if len(chats) < 2:
        return []
    first = [c[0].row.get("messages") for c in chats]
    return chats[0][0].shown if all(f == first[0] for f in first) else []


def _pretty_json(text: Any) -> str:
    if text is None:
        return ""
    try:
        return json.dumps(json.loads(text) if isinstance(text, str) else text, indent=2, ensure_ascii=False)
    except ValueError:
        return str(text)


def _jsonable(p: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in p.items()}

