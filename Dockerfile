# The image of every servemesh service (registry, model, feature, gateway), the control
# plane and the one-shot seed: docker-compose.yml picks the command. CPU-only PyTorch.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Model servers and the sandboxed model child load libseccomp for their syscall filter
# (services/runtime/confine.py): present in Debian's base, named here so it stays.
RUN apt-get update && apt-get install -y --no-install-recommends libseccomp2 \
    && rm -rf /var/lib/apt/lists/*
# torch first, from PyTorch's CPU index (PyPI's default wheel pulls CUDA, gigabytes), in a
# layer of its own that changes only with the pin.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY servemesh ./servemesh
COPY services ./services
COPY registry ./registry
COPY chaos ./chaos
COPY protos ./protos
RUN pip install . && rm -rf /src

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
