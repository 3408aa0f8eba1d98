"""Entry point: python -m servemesh.services.model --spec FILE --instance model-fraud-zone-a-0."""

from __future__ import annotations

from functools import partial

from servemesh.services.model.app import build_server
from servemesh.services.runtime.entry import service_main

if __name__ == "__main__":
    # A model server process of its own confines itself once its models loaded.
    service_main(partial(build_server, confined=True))
