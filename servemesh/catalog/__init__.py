"""The service catalog: where the mesh's instances are. The file catalog lists the resolved
spec's own instances; with `discovery.backend: consul` every service registers itself in
Consul (`registration`) with a gRPC health check over mutual TLS, under the ACLs
`consul_acl` writes. Every service process imports `registration`, so nothing here may
reach the control plane, Envoy or process supervision (servemesh/discovery/)."""
