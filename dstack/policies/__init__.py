"""Scheduling policies and the planning that sets them up (pure; the clock passed in).

`contract` is what every policy offers the dispatch core; `baselines` holds temporal,
shared and spatial; `lane_policy` the dstack policy (lanes shared in time, EDF) and
`lane_planning` its plan (searched by `optimizer.lanes`); `registry` maps a
policy name to its class; `planning` turns a deployment config into a ready policy.
Imports point down only: to `dstack.common` and `optimizer`.
"""
