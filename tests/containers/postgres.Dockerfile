# Stand-in for postgres:16-alpine, from Debian bookworm's postgresql (15), for the container
# tests only. It honours the official image's POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB
# and PGDATA, which is all the compose file uses.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql \
 && rm -rf /var/lib/apt/lists/* \
 && pg_dropcluster 15 main \
 && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
 && chown postgres:postgres /var/lib/postgresql/data /var/run/postgresql \
 && chmod 700 /var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
VOLUME /var/lib/postgresql/data
USER postgres
EXPOSE 5432
ENTRYPOINT ["postgres-entrypoint"]
CMD ["postgres"]
