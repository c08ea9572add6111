# One image for every role; the command picks the role:
#   interactor worker | consumer | submit TASKS | autoscale | metrics | status
#   interactor serve-env --host 0.0.0.0 --port 8080 | serve-model --host 0.0.0.0 --port 8000
# See docker-compose.yml, deploy/k8s/ and docs/deployment.md.

# The base of both stages. Users get python:3.11-slim; the container tests
# (tests/test_containers.py) build from a Python 3.11 image they make from Debian's packages,
# since no image registry is reachable there.
ARG BASE_IMAGE=python:3.11-slim

# --- build: wheels for the project and every dependency (a compiler only lives here) -------
FROM ${BASE_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# A pip configuration and certificate bundle may come in as BuildKit secrets (a mirror or a
# proxy that re-signs TLS): `docker build --secret id=pip.conf,src=... --secret
# id=pip-cert,src=...`. They are mounted for this step only, never stored in a layer; without
# them pip uses PyPI as usual.
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    --mount=type=secret,id=pip-cert,target=/run/secrets/pip-cert \
    pip wheel --no-cache-dir --wheel-dir /wheels .

# --- run ---------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    INTERACTOR_RUN_DIR=/data
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links /wheels interactor \
 && rm -rf /wheels \
 && useradd --create-home --uid 10001 interactor \
 && mkdir -p /data \
 && chown interactor /data
USER interactor
WORKDIR /data
# 8080 example env server, 8000 model stand-in, 9400 metrics, 9401 autoscaler metrics
EXPOSE 8000 8080 9400 9401
# Docker's SIGTERM is Celery's warm shutdown; run with an init (compose: init: true) so it
# reaches the worker and zombies are reaped.
CMD ["interactor", "--help"]
