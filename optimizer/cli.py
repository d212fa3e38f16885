"""Presenting a plan: the table `dstack plan` prints and the Gantt chart of its schedule."""

from __future__ import annotations

from pathlib import Path

from dstack.common.types import Plan, Schedule
from optimizer.packing import pack


def _rps(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def rate_pair(served: float, expected: float) -> tuple[str, str]:
    """Two rates for people: whole numbers, unless rounding would make a shortfall look
    like none (23.7 of 24 shown as "24 of 24"); then one decimal."""
    a, b = _rps(served), _rps(expected)
    if a == b and served != expected:
        a, b = f"{served:.1f}", f"{expected:.1f}"
    return a, b


def format_plan(plan: Plan) -> str:
    """The plan as a table, then the cycle, status and shortfalls."""
    head = (
        f"{'model':20s} {'batch':>5s} {'slice%':>6s} {'latency':>9s} {'start':>8s} "
        f"{'served/expected rps':>21s} {'SLO':>8s}"
    )
    lines = [head, "-" * len(head)]
    for m in plan.models:
        rate = " / ".join(rate_pair(m.served_rps, m.expected_rps))
        lines.append(
            f"{m.model:20s} {m.batch:5d} {m.percent:6g} {m.latency_ms:6.1f} ms "
            f"{m.offset_ms:5.1f} ms {rate:>21s} {m.slo_ms:5g} ms"
        )
    lines.append(
        f"cycle {plan.cycle_ms:.2f} ms; weighted goodput {plan.objective:.1f} rps; "
        f"status {plan.status.value}; solved in {plan.solve_time_s:.2f} s "
        f"({search_status(plan)})"
    )
    lines.extend(f"  short: {s.reason}" for s in plan.shortfalls)
    return "\n".join(lines)


def search_status(plan: Plan) -> str:
    """How the plan's search ended: optimal, or CBC's gap to its bound (a lane plan says
    it in `search`; any other plan only whether it is proven optimal)."""
    said = getattr(plan, "search", "")
    if said:
        return str(said)
    return "proven optimal" if plan.proven_optimal else "best found, not proven optimal"


def draw_gantt(plan: Plan, path: str | Path, schedule: Schedule | None = None) -> None:
    """The schedule (default: the plan packed): time across, slice % up, a rectangle per
    slot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sched = schedule or pack(plan)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    colours = plt.get_cmap("tab10")
    base: dict[float, float] = {}  # shelf start -> % already stacked there
    for i, s in enumerate(sched.slots):
        y = base.get(s.start_ms, 0.0)
        base[s.start_ms] = y + s.percent
        ax.add_patch(
            plt.Rectangle(
                (s.start_ms, y), s.duration_ms, s.percent, color=colours(i % 10), alpha=0.8
            )
        )
        ax.text(
            s.start_ms + s.duration_ms / 2,
            y + s.percent / 2,
            s.model,
            ha="center",
            va="center",
            fontsize=8,
        )
    ax.set_xlim(0, max(sched.cycle_ms, 1e-9))
    ax.set_ylim(0, 100)
    ax.set_xlabel("time in cycle (ms)")
    ax.set_ylabel("slice %")
    ax.set_title(f"cycle {plan.cycle_ms:.1f} ms")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
