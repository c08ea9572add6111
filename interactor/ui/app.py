"""The results browser's Flask app: ``create_app`` puts together its server-rendered pages, a
JSON route the jobs pages poll, and one action (re-drive dead letters) that is off unless asked
for. The routes are in one module per kind of page: the jobs (``job_pages.py``), a job's
episode and group listings (``listings.py``), one group or episode (``episode_pages.py``), one
step's prompt and tokens (``step_pages.py``), the dead letters and their re-drive
(``dead_letter_pages.py``), two jobs side by side (``compare_pages.py``); the guards in
``safety.py``, the template's formatting in ``formatting.py``.

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

import logging
from pathlib import Path

from flask import Flask, render_template, request

from interactor.ui import compare_pages, dead_letter_pages, episode_pages, job_pages, listings, safety, step_pages
from interactor.ui.formatting import advantage, fmt, fmt_dur, fmt_int, fmt_time
from interactor.ui.listings import PAGE_SIZES, sort_link, url_with
from interactor.ui.source import Source

log = logging.getLogger("interactor.ui")

HERE = Path(__file__).resolve().parent
# A step's full prompt is folded into the episode page up to this many messages; longer ones
# (full-history prompts, message_cut 0) get a page of their own, or a long episode's page
# would repeat its whole conversation once per step.
INLINE_PROMPT_MAX = 16


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
    safety.register(app, allowed_hosts)
    _register_page_frame(app, source)
    job_pages.register(app, source)
    listings.register(app, source)
    episode_pages.register(app, source)
    step_pages.register(app, source)
    dead_letter_pages.register(app, source)
    compare_pages.register(app, source)
    return app


def _register_page_frame(app: Flask, source: Source) -> None:
    """What every page shows around its content (the store, the live fleet's state), and the
    error page in place of any failure."""

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
