#!/bin/sh
# Waits until every container of compose project $1 is healthy (the one-shot seed: exited
# 0), then prints the edges' addresses; fails at once on a container unhealthy or exited
# otherwise, and after ${COMPOSE_WAIT_S:-600} s on a start that never ends. `make
# compose-up` runs it after `docker-compose up -d`.
set -eu
project=$1
deadline=$(( $(date +%s) + ${COMPOSE_WAIT_S:-600} ))
while :; do
    states=$(docker ps -a --filter "label=com.docker.compose.project=$project" \
        --format '{{.Label "com.docker.compose.service"}} {{.State}} {{.Status}}')
    pending=$(printf '%s\n' "$states" | grep -v -e '(healthy)' -e '^seed exited Exited (0)' || true)
    if [ -n "$states" ] && [ -z "$pending" ]; then
        break
    fi
    failed=$(printf '%s\n' "$pending" | grep -e '(unhealthy)' -e ' exited ' || true)
    if [ -n "$failed" ] || [ "$(date +%s)" -ge "$deadline" ]; then
        echo "compose project $project did not come up:" >&2
        printf '%s\n' "${failed:-$pending}" >&2
        exit 1
    fi
    sleep 2
done
printf '%s\n' "$states" | sort
echo "edge: $(docker port "$(docker ps -q --filter "label=com.docker.compose.project=$project" \
    --filter label=com.docker.compose.service=envoy)" 8080)" \
    "(TLS; trust deploy/compose/rendered-dns/state/tls/trust.pem)"
echo "zone-b's edge: $(docker port "$(docker ps -q --filter "label=com.docker.compose.project=$project" \
    --filter label=com.docker.compose.service=envoy-edge-zone-b)" 8180)" \
    "(give a caller both edges: docs/architecture.md, \"Calling the mesh\")"
