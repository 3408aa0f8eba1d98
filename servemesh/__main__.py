"""python -m servemesh: the same as the servemesh command."""

from servemesh.cli import main

raise SystemExit(main())
