"""`python -m servemesh.discovery --spec FILE`: the control plane (`servemesh control-plane`)."""

from __future__ import annotations

import argparse
import sys

from servemesh.contract.errors import ServemeshError
from servemesh.discovery.control_plane import add_arguments, run_from_args


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m servemesh.discovery")
    add_arguments(parser)
    try:
        return run_from_args(parser.parse_args())
    except ServemeshError as exc:  # e.g. discovery.backend dns: nothing to follow
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
