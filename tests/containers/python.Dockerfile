# Stand-in for python:3.11-slim, made from Debian bookworm's own packages (Python 3.11), for
# the container tests only: no image registry is reachable where they run.
# Built on the minbase image that tests/dockerhost.py makes with debootstrap.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# A venv on PATH plays the official image's /usr/local: `python` and `pip` answer, and pip may
# install system-wide (Debian's own Python refuses that, PEP 668).
RUN python3 -m venv /opt/python
ENV PATH=/opt/python/bin:$PATH
CMD ["python3"]
