"""The scaler: model servers per zone that follow the traffic between the policy's bounds
(docs/capacity.md). `python -m servemesh.scaling` runs it; loop.py is a round, decide.py the
pure decision, actuator.py the fleet change."""
