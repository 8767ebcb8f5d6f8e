"""The built-in autoscaler: `autoscaler` (one step per due reconcile: observe, plan, scale)."""
