"""The built-in autoscaler: `autoscaler` (one step per due reconcile: observe, plan, scale),
`inputs` (the planner's configuration and observation from the spec and the broker) and `drain`
(a decode scale-down drains the groups that go before the workload is lowered)."""
