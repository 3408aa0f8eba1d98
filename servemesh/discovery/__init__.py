"""The control plane: Envoy's endpoints made from the service catalog (servemesh/catalog/).

`control_plane` watches a catalog (the file catalog, or Consul) and writes Envoy's endpoint
files from it (`endpoints`); `compose` renders what docker-compose.yml mounts. The services
never import this package: they join the catalog through `servemesh.catalog.registration`
(tests/unit/test_floor_plan.py checks what each service process loads).
"""
