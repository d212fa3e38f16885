"""optimizer: the `dstack` lane plan, the MIG advisor and the cluster placement, as
functions over data.

- `optimizer.lanes`: a lane's caps and scores (`best_lane`, `score_lane`), the lane search
  `solve_lanes`, and the exact checks of small instances (`Lanes.exact`, `brute_force`);
- `optimizer.lane_milp`: the set-partitioning MILP over candidate lanes that
  `solve_lanes` runs;
- `optimizer.milp`: binary programs on PuLP + CBC (the only module that imports PuLP);
- `optimizer.mig`, `optimizer.mig_layouts`: the MIG-layout advisor;
- `optimizer.placement`: which models live on which node of a cluster;
- `optimizer.packing`: a plan as a schedule, and the pure check of any schedule.

docs/optimizer.md states the lane formulation with its symbols.
"""

from optimizer.packing import pack, validate_schedule

__all__ = ["pack", "validate_schedule"]
