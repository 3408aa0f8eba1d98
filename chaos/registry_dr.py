"""The registry's disaster recovery as a drill (registry/backup.py): versions pushed under
load, a backup, more pushed after it, the store destroyed, an empty registry restored from
the backup, and what came back.

| fault | restore |
| --- | --- |
| destroy_registry (SIGKILL, store deleted) | restore_registry (empty registry, backup restored) |

`registry_matches_backup` checks every version and alias of the backup is back, each
artifact downloaded and its sha256 verified against the backup's record, and names what
was lost: the versions pushed after the backup (the RPO). `restore_registry` measures the
RTO: from the start of the restore to the registry serving every restored version. Both
are marked on the timeline and written to `registry-restore.md` beside the report.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from servemesh.chaos.drill import current
from servemesh.chaos.errors import DrillError
from servemesh.registry.backup import Manifest, restore, take_backup

__all__ = [
    "push_registry_versions",
    "backup_registry",
    "destroy_registry",
    "restore_registry",
    "registry_matches_backup",
    "registry_holds_backup",
]


@dataclass
class _State:
    """What one drill's steps hand one another."""

    manifest: Manifest | None = None
    backup_at: float = 0.0
    held_before_loss: list[str] = field(default_factory=list)
    destroyed_at: float = 0.0
    rto_s: float | None = None


def _state() -> _State:
    return current().handoff(_State)


def _channel() -> Any:
    from servemesh.contract.wire import message_size_options
    from servemesh.identity import dial_registry

    spec = current().spec
    return dial_registry(spec).aio_channel(
        options=message_size_options(spec.limits.max_message_bytes)
    )


def _credential() -> Any:
    from servemesh.contract.control_credential import control_metadata_for

    return control_metadata_for(current().spec.state_dir)


async def _listing() -> dict[str, Any]:
    from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

    async with _channel() as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        models = (await stub.ListModels(registry_pb2.ListModelsRequest(), timeout=10)).models
        versions = {}
        for model in models:
            listed = await stub.ListVersions(
                registry_pb2.ListVersionsRequest(model=model.name), timeout=10
            )
            versions.update({f"{v.model}/{v.version}": v.sha256 for v in listed.versions})
        return {"aliases": {m.name: dict(m.aliases) for m in models}, "versions": versions}


def push_registry_versions(count: int = 3, prefix: str = "dr", model: str = "fraud") -> list[str]:
    """Push `count` new versions of `model` (demo builds, never routed) while the load runs."""
    from servemesh.contract.demo import demo_artifact, demo_signature
    from servemesh.registry.client import push_version

    drill = current()
    names = [f"{prefix}-{i}" for i in range(1, count + 1)]

    async def push() -> None:
        signature = demo_signature(len(drill.spec.models[model].features))
        async with _channel() as channel:
            for i, version in enumerate(names):
                await push_version(
                    channel, model=model, version=version,
                    data=demo_artifact(100 + i).data, inputs=signature["inputs"],
                    outputs=signature["outputs"], credential=_credential(),
                    labels={"source": "drill"},
                )  # fmt: skip

    asyncio.run(push())
    drill.timeline.mark(f"pushed {', '.join(f'{model}/{n}' for n in names)}")
    return [f"{model}/{n}" for n in names]


def backup_registry() -> dict[str, Any]:
    """A backup of the running registry's store into the drill's folder."""
    drill = current()
    manifest = take_backup(drill.spec.registry_store_dir, drill.out_dir / "registry-backup")
    state = _state()
    state.manifest, state.backup_at = manifest, time.monotonic()
    drill.timeline.mark(
        f"registry backup {manifest.snapshot}: {len(manifest.versions)} versions "
        f"in {manifest.seconds:g} s"
    )
    return {
        "snapshot": manifest.snapshot,
        "versions": len(manifest.versions),
        "new_artifacts": manifest.new_blobs,
        "seconds": manifest.seconds,
    }


def destroy_registry() -> dict[str, Any]:
    """Lose the registry: SIGKILL it and delete its whole store (metadata and artifacts)."""
    drill = current()
    state = _state()
    state.held_before_loss = sorted(asyncio.run(_listing())["versions"])
    killed = {}
    for inst in drill.select("registry"):
        pid = drill.kill(inst.name)
        if pid is not None:
            killed[inst.name] = pid
    store = drill.spec.registry_store_dir
    shutil.rmtree(store)
    state.destroyed_at = time.monotonic()
    drill.timeline.open_window("registry:lost", "registry store lost")
    return {"killed": killed, "deleted": str(store)}


def restore_registry(timeout_s: float = 60.0) -> dict[str, Any]:
    """Start an empty registry (same port) and restore the drill's backup into it; the RTO
    is from here to the registry serving every restored version. Safe to run twice."""
    drill = current()
    mesh = drill.running_mesh
    began = time.monotonic()
    for inst in drill.select("registry"):
        if not mesh.is_running(inst.name):
            mesh.restart(inst.name, timeout_s=timeout_s)
    state = _state()
    manifest = state.manifest
    if manifest is None:
        drill.timeline.close_window("registry:lost")
        return {"restored": None, "why": "no backup was taken"}
    if not asyncio.run(_listing())["versions"]:

        async def run() -> Any:
            async with _channel() as channel:
                return await restore(
                    drill.out_dir / "registry-backup",
                    manifest.snapshot,
                    channel,
                    _credential(),
                    max_artifact_bytes=drill.spec.limits.max_artifact_bytes,
                )

        done = asyncio.run(run())
        state.rto_s = round(time.monotonic() - began, 3)
        drill.timeline.mark(
            f"RTO: registry serving {done.versions} restored versions {state.rto_s:g} s "
            "after the restore began"
        )
    drill.timeline.close_window("registry:lost")
    return {"rto_s": state.rto_s, "snapshot": manifest.snapshot}


def registry_matches_backup() -> dict[str, Any]:
    """Every version and alias of the backup is back, each artifact downloaded and its
    sha256 the backup's; what was pushed after the backup is named as lost (the RPO).
    Marked on the timeline and written to registry-restore.md."""
    drill = current()
    found = _compare()
    lost = found["lost_after_backup"]
    drill.timeline.mark(
        f"RPO: {len(lost)} version(s) lost, pushed after the backup: {', '.join(lost) or '-'}"
    )
    _write_report(drill.out_dir, found)
    return found


def _compare() -> dict[str, Any]:
    from servemesh.registry.client import fetch_verified

    state = _state()
    manifest = state.manifest
    if manifest is None:
        raise DrillError("registry_matches_backup: no backup was taken")
    now = asyncio.run(_listing())
    wanted = {f"{e.model}/{e.version}": e.sha256 for e in manifest.versions}
    missing = sorted(n for n in wanted if n not in now["versions"])
    wrong = sorted(n for n, sha in wanted.items() if now["versions"].get(n, sha) != sha)

    # The records are the backup's (above); each artifact's bytes must match its record.
    checked = [n for n in wanted if n not in missing and n not in wrong]

    async def verify() -> list[str]:
        failed = []
        async with _channel() as channel:
            for name in checked:
                model, _, version = name.partition("/")
                try:
                    await fetch_verified(channel, model, version)
                except Exception as exc:  # any failure is this version's, named
                    failed.append(f"{name}: {type(exc).__name__}: {exc}")
        return failed

    unverified = asyncio.run(verify())
    aliases_back = all(
        now["aliases"].get(model, {}).get(alias) == version
        for model, held in manifest.aliases.items()
        for alias, version in held.items()
    )
    lost = sorted(n for n in state.held_before_loss if n not in wanted)
    rpo_s = round(state.destroyed_at - state.backup_at, 3) if state.destroyed_at else None
    found = {
        "versions_back": len(wanted) - len(missing),
        "versions_in_backup": len(wanted),
        "aliases_back": aliases_back,
        "sha256_verified": len(checked) - len(unverified),
        "missing": missing,
        "wrong_sha256": wrong,
        "unverified": unverified[:10],
        "lost_after_backup": lost,
        "rpo_s": rpo_s,
        "rto_s": state.rto_s,
        "ok": not (missing or wrong or unverified) and aliases_back,
    }
    return found


def _write_report(out_dir: Any, found: dict[str, Any]) -> None:
    lines = [
        "# Registry restore",
        "",
        f"- versions back: {found['versions_back']} of {found['versions_in_backup']} in the "
        f"backup, {found['sha256_verified']} downloaded with their sha256 verified",
        f"- aliases back: {'yes' if found['aliases_back'] else 'NO'}",
        f"- RPO: {len(found['lost_after_backup'])} version(s) lost, pushed after the backup "
        f"(the backup was {found['rpo_s']} s before the loss): "
        f"{', '.join(found['lost_after_backup']) or 'none'}",
        f"- RTO: {found['rto_s']} s from the start of the restore to the registry serving "
        "every restored version",
    ]
    if found["missing"] or found["wrong_sha256"] or found["unverified"]:
        lines += ["", "Not restored:", *(f"- {p}" for p in found["missing"])]
        lines += [f"- {p}" for p in found["wrong_sha256"] + found["unverified"]]
    (out_dir / "registry-restore.md").write_text("\n".join(lines) + "\n")


def registry_holds_backup() -> bool:
    """The steady-state check: every version and alias of the drill's backup is in the
    registry, sha256 verified (true before a backup exists: nothing to hold yet)."""
    if _state().manifest is None:
        return True
    return bool(_compare()["ok"])
