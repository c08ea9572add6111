# Stand-in for redis:7.2-alpine, from Debian bookworm's redis-server (7.0), for the container
# tests only. The compose file gives the whole command line (redis-server --appendonly ...).
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
# /data is the append-only file's volume; a fresh named volume takes this folder's owner.
VOLUME /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
