"""`dstack simulate`: the server's own policy objects on a virtual clock.

- `workload`: arrivals (Poisson, bursts, ramps, CSV traces) from a SPEC string.
- `latency`: L(b, p) for any batch and slice from a profile (interpolation rules there).
- `engine`: the discrete-event loop mirroring `dstack.runtime.serving` (admission, refusal,
  dispatch, contention by processor sharing).
- `ideal`: the ideal bound that no policy can beat: the trace bound (per-request costs
  from the arrivals, time windows) under the fluid LP over the profiles.
- `simulation`: sets up each policy with `dstack.policies.planning.setup_policy` and runs it.
- `report`, `plot`, `cli`: numbers, pictures, the command.
"""

from dstack.simulate.engine import RunResult, SimModel, run
from dstack.simulate.ideal import (
    TraceModel,
    cost_per_request_s,
    fluid_bound,
    ideal_bound_rps,
    trace_bound_rps,
)
from dstack.simulate.latency import latency_ms, latency_table_s
from dstack.simulate.report import PolicyReport, format_table
from dstack.simulate.simulation import Simulation, backend_for, simulate
from dstack.simulate.workload import Arrivals, WorkloadError, generate, read_trace, write_trace

__all__ = [
    "Arrivals",
    "PolicyReport",
    "RunResult",
    "SimModel",
    "TraceModel",
    "Simulation",
    "WorkloadError",
    "backend_for",
    "cost_per_request_s",
    "fluid_bound",
    "format_table",
    "generate",
    "ideal_bound_rps",
    "latency_ms",
    "latency_table_s",
    "read_trace",
    "run",
    "simulate",
    "trace_bound_rps",
    "write_trace",
]
