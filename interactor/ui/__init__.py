"""The results browser: ``interactor ui`` (and ``interactor run --ui``) serves web pages over
a results store (SQLite or PostgreSQL, through its reader methods) and, when given Redis,
the live state of the fleet.

* ``source.py``: what the pages read (store, ledger counts, dead-letter queue, steps/s);
* ``app.py``: the Flask app, made from one module of routes per kind of page: ``job_pages.py``
  (the jobs, a job's overview), ``listings.py`` (a job's episodes and groups, paged),
  ``episode_pages.py`` (one group, one episode), ``step_pages.py`` (a step's prompt, its
  tokens), ``dead_letter_pages.py`` (the dead letters and their re-drive); ``safety.py``: the
  Host check, the headers and the guard on actions; ``formatting.py``: how values are shown;
* ``transcript.py``: an episode's steps as one chat; ``plots.py``: inline SVG plots;
* ``server.py``: the HTTP server; ``command.py``: the command line.
* ``templates/`` and ``static/``: Jinja2 pages, the CSS and the little JavaScript, served by
  the package (nothing is fetched from elsewhere; it works offline).

Nothing here is imported by the other packages, and importing this package does not import
Flask: the command line builds its parser without it.
"""

DEFAULT_PORT = 8050  # the results browser's port (interactor ui, interactor run --ui)
