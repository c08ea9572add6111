"""The results browser's listings of a job: its episodes and its groups, filtered, sorted and
keyset-paged, and the page links they build from the request's query."""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import urlencode

from flask import Flask, abort, render_template, request

from interactor.ui.source import AGGREGATE_TTL_S, Source

PAGE_SIZES = (25, 50, 100, 200, 500)
DEFAULT_PAGE = 50


def register(app: Flask, source: Source) -> None:
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
