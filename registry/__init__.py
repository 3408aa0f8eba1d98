"""The model registry: immutable, verified model versions, their artifacts and aliases.

Components talk to it through `servemesh.registry.client`; `python -m servemesh.registry`
runs it.
"""
