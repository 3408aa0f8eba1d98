"""`python -m servemesh.discovery --spec FILE`: the control plane (`servemesh control-plane`)."""

from __future__ import annotations

import argparse

from servemesh.discovery.control_plane import add_arguments, run_from_args


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m servemesh.discovery")
    add_arguments(parser)
    return run_from_args(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
