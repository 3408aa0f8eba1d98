"""Proof that a path runs model code in a sandboxed child, not in the caller (tests only).

`sandbox_spy(monkeypatch)` records every SandboxedModel.open (its entry, and the child's
seccomp mode and uid read from /proc while it is open), and makes every in-process way of
loading a model raise: a path that still loaded a model in this process fails, one that
opens no child is seen opening none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from servemesh.sandbox.model import SandboxedModel


@dataclass
class Opened:
    entry: tuple[str, ...]
    pid: int
    seccomp: str
    uid: str


@dataclass
class Spy:
    opened: list[Opened] = field(default_factory=list)


def status_of(pid: int) -> dict[str, str]:
    """The fields of /proc/<pid>/status, by name."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _in_process(*_: Any, **__: Any) -> Any:
    raise AssertionError("a model was loaded in the operator's process")


def sandbox_spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    import torch

    from servemesh.services.model import artifacts, runner, torchscript_guard

    spy = Spy()
    real_open = SandboxedModel.open.__func__  # type: ignore[attr-defined]

    def open_(cls: type[SandboxedModel], /, data: bytes, **kwargs: Any) -> SandboxedModel:
        model = real_open(cls, data, **kwargs)
        status = status_of(model.pid)
        entry = tuple(kwargs.get("entry", ("-m", "servemesh.sandbox.child")))
        spy.opened.append(Opened(entry, model.pid, status["Seccomp"].strip(),
                                 status["Uid"].split()[0]))  # fmt: skip
        return model

    monkeypatch.setattr(SandboxedModel, "open", classmethod(open_))
    for owner, name in [
        (artifacts, "open_artifact"),
        (artifacts, "load_module"),
        (torchscript_guard, "load_checked"),
        (torch.jit, "load"),
        (torch.export, "load"),
    ]:
        monkeypatch.setattr(owner, name, _in_process)
    monkeypatch.setattr(runner.ModelRunner, "from_bytes", classmethod(_in_process))
    return spy
