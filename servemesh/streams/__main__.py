from servemesh.streams.process import main

raise SystemExit(main())
