"""`servemesh registry backup|snapshots|restore` as an operator runs them, against real
registries on loopback (mutual TLS with the state dir's certificates, as a running mesh
serves) found through a state dir: a backup of the mesh's store, its listing, a restore
refused by a registry that holds models, and one into an empty registry that brings every
version and alias back."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from servemesh.contract.demo import Artifact
from servemesh.identity import dial_address, serving_credentials
from servemesh.registry.app import registry_server
from servemesh.registry.client import push_version, set_alias
from servemesh.registry.store import RegistryStore
from servemesh.spec import ResolvedSpec
from tests.control_kit import TEST_CREDENTIAL, TEST_TOKEN, credentialed_channel
from tests.model.model_helpers import REPLICA
from tests.registry.registry_kit import INPUTS, MAX_ARTIFACT_BYTES, OUTPUTS
from tests.registry.test_models_cli import mesh_state, planned_spec

pytestmark = pytest.mark.timeout(300)


@asynccontextmanager
async def serving(spec: ResolvedSpec) -> AsyncIterator[tuple[RegistryStore, str]]:
    """The registry of `spec`'s state dir, serving, and a state dir naming it."""
    store = RegistryStore(spec.registry_store_dir, MAX_ARTIFACT_BYTES)
    server = registry_server(
        store, spec.registry_instance, port=0, control_token=TEST_TOKEN,
        credentials=serving_credentials(spec, spec.registry_instance),
    )  # fmt: skip
    address = f"127.0.0.1:{await server.start()}"
    mesh_state(spec, address, "127.0.0.1:9")  # no model server is asked for here
    try:
        yield store, address
    finally:
        await server.drain()


async def cli(state_dir: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "servemesh", "registry", "--state-dir", str(state_dir), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_back_up_list_and_restore_into_an_empty_registry(
    tmp_path: Path, demo1: Artifact, demo2: Artifact
) -> None:
    first = planned_spec(tmp_path / "first")
    async with serving(first) as (store, address):
        dial = dial_address(first, address, first.registry_instance, caller=REPLICA)
        channel = credentialed_channel(dial)
        try:
            for version, art in (("v1", demo1), ("v2", demo2)):
                await push_version(
                    channel, model="fraud", version=version, data=art.data, inputs=INPUTS,
                    outputs=OUTPUTS, credential=TEST_CREDENTIAL, lineage={"run": version},
                )  # fmt: skip
            await set_alias(channel, "fraud", "stable", "v1", credential=TEST_CREDENTIAL)
        finally:
            await channel.close()
        code, out, err = await cli(Path(first.state_dir), "backup", "--json")
        assert code == 0, err
        taken = json.loads(out)
        assert [e["version"] for e in taken["versions"]] == ["v1", "v2"]
        backups = Path(first.state_dir) / "registry-backups"
        code, out, err = await cli(Path(first.state_dir), "snapshots", "--json")
        assert code == 0, err
        assert [s["snapshot"] for s in json.loads(out)] == [taken["snapshot"]]
        # This registry holds models: refused, one line, exit 1.
        code, out, err = await cli(Path(first.state_dir), "restore", str(backups))
        assert code == 1
        assert "not empty" in err and "fraud" in err and "Traceback" not in err

    second = planned_spec(tmp_path / "second")
    async with serving(second) as (fresh, _address):
        code, out, err = await cli(Path(second.state_dir), "restore", str(backups))
        assert code == 0, err
        assert "2 versions, 1 aliases" in out
        assert [v.version for v in fresh.list_versions("fraud")] == ["v1", "v2"]
        assert fresh.get_model("fraud").aliases == {"stable": "v1"}
        assert dict(fresh.get_version("fraud", "v2").lineage) == {"run": "v2"}
