# The model server's image: the service image plus CPU-only PyTorch 2.13.0 (and its own
# dependencies), from the wheelhouse `make images` prepares (build/images/model). The CPU
# wheel comes from the wheelhouse because the package index alone resolves torch==2.13.0
# to the CUDA build (gigabytes of nvidia-* wheels).
ARG BASE=python:3.11-slim
ARG SERVICE_IMAGE=servemesh-service:dev

# torch is unpacked on the bare base, not on the service image: a change of servemesh's
# source then rebuilds the service image's small top layer and the copy below, never this.
FROM ${BASE} AS torch
LABEL org.servemesh.image=build-stage
COPY wheels /wheels
RUN python3 -m venv /tmp/pip \
    && /tmp/pip/bin/pip install --no-index --find-links /wheels --no-cache-dir \
        --disable-pip-version-check --target /opt/torch torch==2.13.0 \
    && rm -rf /opt/torch/bin

FROM ${SERVICE_IMAGE}
# Every image and build stage `make images` makes carries this label: `make images-clean`
# removes them by it, and nothing else.
LABEL org.servemesh.image=model
# Into the venv's own site-packages: the sandboxed model child runs Python with -I
# (PYTHONPATH ignored). The build fails when that is not the venv the image runs.
ARG SITE_PACKAGES=/opt/servemesh/lib/python3.11/site-packages
COPY --from=torch /opt/torch/ ${SITE_PACKAGES}/
RUN test "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" = "${SITE_PACKAGES}" \
    && python3 -I -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
