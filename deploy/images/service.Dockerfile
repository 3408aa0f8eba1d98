# The image of every servemesh service without PyTorch: gateway, feature, registry, the
# trace store, the control plane and the one-shot seed. model.Dockerfile adds torch on top.
# Built by `make images` from the wheelhouse it prepares (build/images/service: deps/ and
# app/); pip installs with --no-index, so the build reaches no package index and no pip
# configuration or credential enters a layer.
ARG BASE=python:3.11-slim

FROM ${BASE} AS deps
LABEL org.servemesh.image=build-stage
# The dependencies in a stage of their own: the image takes only the finished venv, and
# that layer changes only when pyproject.toml does.
COPY deps /wheels
RUN python3 -m venv /opt/servemesh \
    && /opt/servemesh/bin/pip install --no-index --find-links /wheels --no-cache-dir \
        --disable-pip-version-check -r /wheels/requirements.txt

FROM ${BASE}
# Every image and build stage `make images` makes carries this label: `make images-clean`
# removes them by it, and nothing else.
LABEL org.servemesh.image=service
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/servemesh/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY --from=deps /opt/servemesh /opt/servemesh
# The project itself, last: a change of source rebuilds this small layer only.
COPY app /tmp/app
RUN pip install --no-index --no-deps /tmp/app/*.whl && rm -rf /tmp/app

# Not root. docker-compose.yml runs each container as the user who rendered its
# certificates (compose.env), which need not exist here.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin servemesh \
    && install -d -o servemesh -m 0700 /var/lib/servemesh
USER servemesh
WORKDIR /var/lib/servemesh

# gRPC health of the instance the container's command names, over mutual TLS with the
# instance's own certificate (servemesh compose probe).
HEALTHCHECK --interval=5s --timeout=4s --start-period=120s --retries=3 \
    CMD ["servemesh", "compose", "probe", "--spec", "/etc/servemesh/mesh.yaml"]

CMD ["servemesh", "--help"]
