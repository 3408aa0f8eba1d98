"""Development tools: the protobuf code generator and the type check `make` runs."""
