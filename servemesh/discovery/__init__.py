"""Service discovery: where the mesh's instances are, and Envoy's endpoints made from it.

A `Catalog` lists the instances of each service kind. Two stand behind it: the file
catalog (the resolved spec's own instances and ports: what `servemesh up` runs) and
Consul, where every service registers itself with a gRPC health check over mutual TLS
(`registration`) when the spec's `discovery.backend` is `consul`. The control plane
(`control_plane`) watches a catalog and writes Envoy's endpoint files from it
(`endpoints`); `compose` renders what docker-compose.yml mounts.

Import what you need from its modules: every service process imports `registration`, and
must not load the control plane's Envoy renderer (nor py-consul, with the file catalog)
on the way (tests/unit/test_floor_plan.py checks what each service process loads).
"""
