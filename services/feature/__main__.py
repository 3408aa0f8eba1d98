"""Entry point: python -m servemesh.services.feature --spec FILE --instance NAME."""

from __future__ import annotations

from servemesh.services.feature.app import build_server
from servemesh.services.runtime.entry import service_main

if __name__ == "__main__":
    service_main(build_server)
