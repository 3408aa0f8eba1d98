#!/bin/sh
# Waits until every service of Swarm stack $1 runs all its replicas (Swarm counts a task
# with a health check as running once it is healthy) and its one-shot seed has completed,
# then prints the services and the edges' addresses; fails after ${SWARM_WAIT_S:-600} s,
# printing what is still pending. `make swarm-up` runs it after `docker stack deploy`.
set -eu
stack=$1
deadline=$(( $(date +%s) + ${SWARM_WAIT_S:-600} ))
while :; do
    services=$(docker service ls --filter "label=com.docker.stack.namespace=$stack" \
        --format '{{.Name}} {{.Replicas}}' | sort)
    pending=$(printf '%s\n' "$services" | awk -v seed="${stack}_seed" \
        '$1 != seed { split($2, r, "/"); if (r[1] != r[2] || r[2] == 0) print }')
    seed=$(docker service ps "${stack}_seed" --format '{{.CurrentState}}' 2>/dev/null || true)
    if [ -n "$services" ] && [ -z "$pending" ] && printf '%s\n' "$seed" | grep -q '^Complete'; then
        break
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "stack $stack did not come up; pending:" >&2
        printf '%s\n' "${pending:-seed: $seed}" >&2
        exit 1
    fi
    sleep 2
done
printf '%s\n' "$services"
echo "edge: 127.0.0.1:${SERVEMESH_EDGE_PORT:-8443}" \
    "(TLS; trust deploy/compose/rendered-dns/state/tls/trust.pem)"
echo "zone-b's edge: 127.0.0.1:${SERVEMESH_ZONE_B_EDGE_PORT:-8543}"
