"""The results browser's pages of one group (its members side by side) and one episode (its
transcript, attempts, group, superseded steps and dead letter)."""

from __future__ import annotations

import json
from typing import Any

from flask import Flask, abort, render_template

from broker.states import Phase, StoredStatus
from interactor.ui import transcript
from interactor.ui.source import Source


def register(app: Flask, source: Source) -> None:
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
