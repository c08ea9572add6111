"""The command line and everything on top of the roles: local runs, metrics, the autoscaler,
the results browser, the rollout feed's server (docs/architecture.md).

A gevent worker process must patch the standard library before anything loads socket or ssl,
which is what `celery -P gevent` does first thing: patching later works, but gevent warns
that it "may lead to errors, including RecursionError" in every worker's log. The worker's
supervisor (interactor/cli.py) asks its child to patch here, at the package's first import.
"""

import os

if os.environ.get("INTERACTOR_WORKER_CHILD") == "1" and os.environ.get("INTERACTOR_GEVENT_EARLY") == "1":
    from gevent import monkey

    monkey.patch_all()
