# Redis from Debian's package (bookworm: 7.0), for the feature store and the tiers.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
# Every image and build stage `make images` makes carries this label: `make images-clean`
# removes them by it, and nothing else.
LABEL org.servemesh.image=redis
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o redis -g redis -m 0700 /data
# The package's user; its config (protected mode, password, renamed commands) is mounted.
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "yes"]
