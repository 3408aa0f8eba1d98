"""servemesh's Chaos Toolkit extension: drills that inject failures into a local mesh and
prove it holds.

- `servemesh.chaos.control`: the control every drill declares; it starts the drill's own
  mesh and background load, arms the guard during the method, writes the report.
- `servemesh.chaos.actions`: the faults, each with the action that undoes it.
- `servemesh.chaos.probes`: what callers see (success, latency, traffic per zone and
  version), what Envoy sees, and whether services and Redis answer.
- `servemesh.chaos.drill`: one running drill (its mesh, `chaos.mesh`, and its load), with
  its timeline (`chaos.timeline`), guard (`chaos.guard`), what faults leave running
  (`chaos.leftovers`) and which instances a fault acts on (`chaos.scope`).
- `servemesh.chaos.runner` (its command in servemesh/cli/chaos.py): `servemesh chaos run
  FILE`, `servemesh chaos list`. The drills themselves are in `chaos/experiments/`.
"""
