"""A mesh's state dir: what `servemesh up` keeps private there and shares with sandboxed
model servers, the lock a running mesh holds, what rollouts record, and the credentials a
caller presents at the edge."""
