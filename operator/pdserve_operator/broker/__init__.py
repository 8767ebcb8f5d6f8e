"""The broker and the operator's view of it: `server` (gRPC face and in-process host),
`registry` (members, leases, watches), `view` (what reconciling asks of it) and `tokens`
(the services' tokens loaded at operator start)."""
