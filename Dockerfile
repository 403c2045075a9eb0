# syntax=docker/dockerfile:1
# room-outbox: `docker build -t room-outbox .`, then see docker-compose.yml.
#
# Two stages: the first builds a virtualenv with room-outbox and its dependencies (pip, wheel
# caches and build tools stay there); the second copies only that virtualenv onto a slim
# Python and runs it as an unprivileged user.

# A patch release, so a rebuild gets the same interpreter; move it on purpose.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/room-outbox
WORKDIR /src
# The locked dependencies first, in a layer of their own: a code change does not reinstall
# them. --require-hashes: every file must match requirements.lock's hashes.
COPY requirements.lock ./
RUN /opt/room-outbox/bin/pip install --require-hashes --no-deps -r requirements.lock
COPY pyproject.toml README.md ./
COPY core ./core
COPY plugins ./plugins
# --no-deps: nothing beyond the lock; `pip check` fails the build if the lock misses a requirement.
RUN /opt/room-outbox/bin/pip install --no-deps . \
 && /opt/room-outbox/bin/pip check \
 && /opt/room-outbox/bin/room-outbox --help >/dev/null

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 room-outbox \
 && useradd --system --uid 10001 --gid room-outbox --no-create-home --shell /usr/sbin/nologin room-outbox
COPY --from=build /opt/room-outbox /opt/room-outbox
COPY config/config.docker.yaml /etc/room-outbox/config.yaml
# The HTTP endpoint is on in the image whatever config file is mounted, so the HEALTHCHECK
# below always has something to probe. Loopback only: it has no authentication. A scraper in
# another container needs `-e ROOM_OUTBOX__TELEMETRY__HTTP_LISTEN=0.0.0.0:9464`, an explicit
# choice to pair with a private network (no published port, or one on 127.0.0.1).
ENV PATH=/opt/room-outbox/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ROOM_OUTBOX__TELEMETRY__HTTP_LISTEN=127.0.0.1:9464
USER 10001:10001
# /healthz, /readyz, /metrics (telemetry.http_listen, set above).
EXPOSE 9464
# /healthz fails when a lane has stopped ending rounds (stuck for good: restart); /readyz
# (database, failed rounds, worker) is for orchestrators that route traffic or gate rollouts. Python's urllib: the slim image has no curl.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["room-outbox"]
CMD ["run", "--config", "/etc/room-outbox/config.yaml"]
