"""Entry point: python -m servemesh.registry --spec FILE --instance registry-0."""

from __future__ import annotations

from servemesh.registry.app import build_server
from servemesh.services.runtime.entry import service_main

if __name__ == "__main__":
    service_main(build_server)
