"""`python -m servemesh.procs.forkserver`: the fork server (servemesh.procs.forkserver)."""

from servemesh.procs.forkserver.server import main

raise SystemExit(main())
