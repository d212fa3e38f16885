"""Many devices: placement of models over nodes (`optimizer.placement` with the `dstack`
planner as the node scorer), simulated fleets, and serving on Ray (docs/cluster.md)."""
