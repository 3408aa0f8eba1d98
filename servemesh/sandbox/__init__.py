"""Model code runs only in a sandbox: a process of its own, its own user, no secrets,
rlimits and a syscall filter (docs/security.md).

    from servemesh.sandbox.model import SandboxedModel
    with SandboxedModel.open(data, declared=signature) as model:   # a fresh child
        answer = model.probe()                                      # outputs only

- `model.SandboxedModel`: a model loaded in a sandboxed child; `probe`/`run` send rows
  and get arrays back. Errors: `ModelRefused` (the guard), `ModelFailed` (the model
  raised), `ModelCrashed` (the child died, and why: a crash, a forbidden call, a limit).
- `child`: the child's own side (`python -I -B -m servemesh.sandbox.child`).
- `frames`: the pipe between them.

The walls themselves (`confine`, `SandboxPolicy`) live in the service runtime
(`services/runtime/confine.py`): model servers put them up around themselves too. This
module imports only what the child itself needs (the child imports it before it confines
itself); the caller's side lives in `servemesh.sandbox.model`.
"""

from __future__ import annotations

from servemesh.services.runtime.confine import ConfineError, SandboxPolicy, confine

__all__ = ["ConfineError", "SandboxPolicy", "confine"]
