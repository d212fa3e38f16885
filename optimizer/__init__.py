"""optimizer: every model's batch size, slice % and place in the cycle, under SLOs.

Formulation (the shelf model; exact for the continuous cycle)
--------------------------------------------------------------
Data. Models m with weight w_m (priority), SLO_m (ms), expected rate R_m (rps; an SLO
with rate 0, "unknown", is given R_m = the model's capacity at its smallest batch on its
largest slice run back to back, 1000 * b_min / L_m(b_min, p_max), so it is served like a
model that wants one device's worth of batch-1 work and does not crowd out declared
demand indefinitely). Candidate choices c = (b, p) from the profile (batch sizes x slice
percentages, optionally restricted), each with latency L_m(b, p) in ms (p50).

Decisions. Each model m takes exactly one choice (b_m, p_m) and one shelf k. Shelves run
one after another inside the cycle; the models of shelf k start together at its start
and run concurrently. D_k is the shelf's duration. T is the cycle (ms, continuous). Each
model runs one batch per cycle (runs_per_cycle = 1).

Constraints.
    T + L_m(b_m, p_m) <= SLO_m          a request may wait a whole cycle, then run
    sum_{m in k} p_m <= 100             every shelf fits on the device
    D_k >= L_m(b_m, p_m) for m in k     a shelf lasts as long as its longest member
    sum_k D_k <= T                      the shelves fit in the cycle

Objective, lexicographic.
    1. (only when not every model can be placed) maximise sum_m w_m [m placed]
    2. maximise goodput G = sum_m w_m * served_m,  served_m = min(R_m, 1000 * b_m / T)
    3. minimise device share H = sum_m p_m * L_m / (100 T)   (fraction of device-time)
Stage 3 keeps G >= (1 - 1e-7) G*; no fixed small coefficient is used because with a
continuous T no positive coefficient provably never trades goodput.

Solving. `optimizer/milp.py` writes this as one MILP in u = 1/T (see there): b/T, the
latency bound and the shelf bound all become linear in z[m,c,k] = u * x[m,c,k], which is
linearised exactly because x is binary and u is bounded. T is therefore not restricted to
a finite set. For a fixed assignment (choice and shelf per model) the best T is one of
`cycle_candidates` (the makespan sum_k D_k, a cap SLO_m - L_m, or a saturation point
1000 * b_m / R_m); after CBC picks the assignment the plan's T is recomputed from them
exactly, and the brute force in the tests enumerates assignments and those candidates.
Instances whose MILP is too large (over `solve.MILP_MAX_BINARIES` binaries) are answered
by the constructive heuristic of `optimizer/heuristic.py`, which also backs CBC up when it
stops at the time limit; `Plan.proven_optimal` says which it was.

Shortfalls. A model with L_m(b_min, p_max) >= SLO_m, or whose fastest choice L satisfies
2L > SLO_m (T >= L always), cannot be placed: status INFEASIBLE, named with its numbers.
A placed model served below R_m is named with served vs expected: status PARTIAL.
"""

from optimizer.formulation import SolveOptions, cycle_candidates
from optimizer.packing import pack, validate_schedule
from optimizer.solve import solve

__all__ = ["SolveOptions", "cycle_candidates", "pack", "solve", "validate_schedule"]
