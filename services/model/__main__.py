"""Entry point: python -m servemesh.services.model --spec FILE --instance model-zone-a-0."""

from __future__ import annotations

from servemesh.services.model.service import build_server
from servemesh.services.runtime.entry import service_main

if __name__ == "__main__":
    service_main(build_server)
