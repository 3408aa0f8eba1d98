"""A fuzz campaign against a running mesh: generated requests on every public RPC of the
gateway, model server (OIP), feature service and registry, through Envoy and directly,
while a trickle of valid Predicts must keep succeeding and no replica may die or grow.

`servemesh fuzz` (`cli.py`) runs it on a mesh of its own; tests/fuzz/ runs a short one.
`campaign.run_campaign` is the entry point; it needs hypothesis (the test extras), which
the command imports only when it runs.
"""
