"""One reconcile of one PDInferenceService: `reconciler` (the straight-line sync), `children`
(the objects a spec renders, one module per kind), `drift` (live against rendered), `status`,
`decode_groups` (which workload runs the decode groups) and `scaling_adapters`."""
