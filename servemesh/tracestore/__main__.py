"""`python -m servemesh.tracestore --spec RESOLVED`: the embedded OTLP receiver."""

from servemesh.tracestore.receiver import main

main()
