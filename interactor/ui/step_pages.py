"""The results browser's pages of one step: its full prompt as sent, and its tokens (ids, texts,
logprobs, and where the episode's token stream stands at it)."""

from __future__ import annotations

import math

from flask import Flask, abort, render_template

from interactor.ui import transcript
from interactor.ui.source import Source


def register(app: Flask, source: Source) -> None:
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
