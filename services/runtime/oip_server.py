"""What a servemesh process says of itself as an OIP server (ServerMetadata): a model
server, or a gateway answering OIP for callers at the edge."""

from __future__ import annotations

from functools import cache
from importlib import metadata

SERVER_NAME = "servemesh"


@cache
def server_version() -> str:
    """The installed servemesh's version ("0" where it is not installed as a package)."""
    try:
        return metadata.version("servemesh")
    except metadata.PackageNotFoundError:
        return "0"
