"""The embedded trace store: an OTLP receiver writing spans to SQLite, and `servemesh trace`."""
