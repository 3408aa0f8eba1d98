# Prometheus from Debian's package (bookworm: 2.42), with promtool for rendered configs.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
# Every image and build stage `make images` makes carries this label: `make images-clean`
# removes them by it, and nothing else.
LABEL org.servemesh.image=prometheus
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o prometheus -g prometheus -m 0700 /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
