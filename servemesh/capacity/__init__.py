"""Capacity planning: how many replicas of each kind a target rate needs at its SLO, and
what they cost (`servemesh capacity plan`, docs/capacity.md)."""
