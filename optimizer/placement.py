"""Placement: which models live on which node, and how many copies a hot model gets.

Pure functions over data (no processes, no solver library). The caller supplies the
*node scorer*, the planner that predicts the weighted goodput of one node given the
copies placed on it (`dstack.cluster.planning` wraps the `dstack` lane planner); this
module searches over assignments.

Decisions: x[m, n] in {0, 1, ...} copies of model m on node n, k_m = sum_n x[m, n] <=
`max_copies`. Every copy of m carries r_m / k_m (the ingress spreads a model's requests
over its copies). Node n's copies' memory, sum_m x[m, n] * mem_m(kind_n), stays within
memory_n. The key, compared lexicographically (docs/cluster.md):

1. G = sum_n score_n(x[., n], r / k), the predicted weighted goodput (values within
   `RESOLUTION` rps are equal, so residency is kept only where it costs no goodput);
2. fewer *starts*: copies on a node where the model is not resident (a start-up each);
3. fewer copies in all (each is a process and a copy of the weights);
4. fewer copies stacked on one node (replicas of one model spread over nodes).

`exact` is a dynamic programme over nodes for every vector k (exact for the scorer;
small instances only), `brute_force` enumerates every x (tests), `greedy` places copies by
demand (worst fit, resident nodes first) and improves by local search under a time budget.
`place` picks `exact` when the instance is small enough.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

#: Predicted weighted goodputs closer than this many requests/s are equal (the planner's
#: figures are sums of floats): the other criteria (residency, copies, spread) decide.
RESOLUTION = 1e-3
#: `place` solves exactly when the DP would score at most this many node configurations.
EXACT_MAX_STATES = 200


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One device. Nodes of one `kind` are interchangeable for the scorer (same device,
    same profiles); `resident` names the models already loaded there."""

    name: str
    kind: str
    memory_mb: float
    resident: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One model. `memory_mb[kind]`: one copy's memory on that kind of node (a kind absent
    from it cannot run the model). `demand[kind]`: the share of one device its whole rate
    needs there at best (for the greedy's order and balance; inf if it cannot meet its
    SLO there). `min_copies`: copies its rate needs at least (one copy on a whole device
    cannot carry more)."""

    name: str
    rate_rps: float
    weight: float
    memory_mb: Mapping[str, float]
    demand: Mapping[str, float] = field(default_factory=dict)
    max_copies: int = 1
    min_copies: int = 1


@dataclass(frozen=True, slots=True)
class NodeScore:
    """A node's predicted weighted goodput and each model's served rps there."""

    value: float
    served: Mapping[str, float]


#: (node kind, ((model, copies on the node, rate per copy), ...) sorted by model) -> score.
NodeScorer = Callable[[str, tuple[tuple[str, int, float], ...]], NodeScore]

Key = tuple[float, int, int, int]  # (G, -starts, -copies, -stacked)


@dataclass(frozen=True, slots=True)
class Placement:
    copies: dict[str, dict[str, int]]  # node -> model -> copies there (only > 0)
    value: float  # predicted weighted goodput, sum over nodes
    node_values: dict[str, float]
    served: dict[str, float]  # model -> predicted rps served over all its copies
    starts: int  # copies placed where their model was not resident
    method: str  # "exact" | "greedy"
    proven_optimal: bool  # exact for the scorer
    solve_s: float
    evaluations: int  # distinct node configurations scored

    def copies_of(self, model: str) -> dict[str, int]:
        return {n: c[model] for n, c in self.copies.items() if c.get(model)}

    def total_copies(self, model: str) -> int:
        return sum(self.copies_of(model).values())


class _Scores:
    """The scorer with a cache (the searches score the same node configuration often)."""

    def __init__(self, scorer: NodeScorer) -> None:
        self.scorer = scorer
        self.cache: dict[tuple[str, tuple[tuple[str, int, float], ...]], NodeScore] = {}

    def __call__(self, kind: str, x: Mapping[str, int], k: Mapping[str, int],
                 models: Mapping[str, ModelDemand]) -> NodeScore:
        workers = tuple(sorted((m, c, models[m].rate_rps / k[m]) for m, c in x.items() if c > 0))
        key = (kind, workers)
        got = self.cache.get(key)
        if got is None:
            got = self.scorer(kind, workers) if workers else NodeScore(0.0, {})
            self.cache[key] = got
        return got


def _node_key(node: NodeSpec, x: Mapping[str, int], value: float) -> Key:
    starts = sum(1 for m, c in x.items() if c > 0 and m not in node.resident)
    copies = sum(x.values())
    stacked = sum(c - 1 for c in x.values() if c > 1)
    return (value, -starts, -copies, -stacked)


def _add(a: Key, b: Key) -> Key:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


def better(a: Key, b: Key) -> bool:
    """a is preferred to b: more G by more than `RESOLUTION`, or as much and the rest."""
    if a[0] > b[0] + RESOLUTION:
        return True
    return abs(a[0] - b[0]) <= RESOLUTION and a[1:] > b[1:]


def _sub(a: Key, b: Key) -> Key:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3])


def _fits(node: NodeSpec, x: Mapping[str, int], models: Mapping[str, ModelDemand]) -> bool:
    used = 0.0
    for m, c in x.items():
        if c <= 0:
            continue
        mem = models[m].memory_mb.get(node.kind)
        if mem is None:
            return False
        used += c * mem
    return used <= node.memory_mb + 1e-9


def _result(nodes: Sequence[NodeSpec], models: Mapping[str, ModelDemand],
            x: Mapping[str, Mapping[str, int]], scores: _Scores, method: str, proven: bool,
            t0: float) -> Placement:
    k = {m: sum(x[n.name].get(m, 0) for n in nodes) for m in models}
    copies: dict[str, dict[str, int]] = {}
    node_values: dict[str, float] = {}
    served = {m: 0.0 for m in models}
    starts = 0
    for n in nodes:
        xn = {m: c for m, c in x[n.name].items() if c > 0}
        copies[n.name] = dict(sorted(xn.items()))
        s = scores(n.kind, xn, k, models)
        node_values[n.name] = s.value
        for m, v in s.served.items():
            served[m] += v
        starts += sum(1 for m in xn if m not in n.resident)
    return Placement(copies, sum(node_values.values()), node_values, served, starts, method,
                     proven, time.perf_counter() - t0, len(scores.cache))


def _copy_ranges(models: Mapping[str, ModelDemand]) -> list[range]:
    return [range(0, md.max_copies + 1) for md in models.values()]


def exact(nodes: Sequence[NodeSpec], models: Sequence[ModelDemand],
          scorer: NodeScorer) -> Placement:
    """The best placement for `scorer` (the module's key): for every vector k of total
    copies, a DP over the nodes whose state is the copies still to place."""
    t0 = time.perf_counter()
    by_name = {m.name: m for m in models}
    names = list(by_name)
    scores = _Scores(scorer)
    best: tuple[Key, dict[str, dict[str, int]]] | None = None
    for kv in itertools.product(*_copy_ranges(by_name)):
        k = dict(zip(names, kv, strict=True))
        kpos = {m: max(c, 1) for m, c in k.items()}  # rate per copy; unused where c = 0
        states: dict[tuple[int, ...], tuple[Key, tuple[tuple[int, ...], ...]]] = {
            tuple(kv): ((0.0, 0, 0, 0), ())}
        for node in nodes:
            nxt: dict[tuple[int, ...], tuple[Key, tuple[tuple[int, ...], ...]]] = {}
            for left, (key, path) in states.items():
                for take in itertools.product(*(range(0, c + 1) for c in left)):
                    xn = {m: c for m, c in zip(names, take, strict=True) if c > 0}
                    if not _fits(node, xn, by_name):
                        continue
                    s = scores(node.kind, xn, kpos, by_name)
                    k2 = _add(key, _node_key(node, xn, s.value))
                    rest = tuple(a - b for a, b in zip(left, take, strict=True))
                    if rest not in nxt or better(k2, nxt[rest][0]):
                        nxt[rest] = (k2, (*path, take))
            states = nxt
        done = states.get(tuple(0 for _ in names))
        if done is None:
            continue
        if best is None or better(done[0], best[0]):
            x = {n.name: {m: c for m, c in zip(names, take, strict=True) if c > 0}
                 for n, take in zip(nodes, done[1], strict=True)}
            best = (done[0], x)
    assert best is not None  # placing nothing is always feasible
    return _result(nodes, by_name, best[1], scores, "exact", True, t0)


def brute_force(nodes: Sequence[NodeSpec], models: Sequence[ModelDemand],
                scorer: NodeScorer) -> tuple[Key, Placement]:
    """Every x[m, n] (tests only: (max_copies + 1) ** (models x nodes) assignments)."""
    t0 = time.perf_counter()
    by_name = {m.name: m for m in models}
    names = list(by_name)
    scores = _Scores(scorer)
    cells = [(n, m) for n in nodes for m in names]
    best: tuple[Key, dict[str, dict[str, int]]] | None = None
    for xs in itertools.product(*(range(0, by_name[m].max_copies + 1) for _, m in cells)):
        x: dict[str, dict[str, int]] = {n.name: {} for n in nodes}
        for (n, m), c in zip(cells, xs, strict=True):
            if c:
                x[n.name][m] = c
        k = {m: sum(x[n.name].get(m, 0) for n in nodes) for m in names}
        if any(k[m] > by_name[m].max_copies for m in names):
            continue
        if not all(_fits(n, x[n.name], by_name) for n in nodes):
            continue
        kpos = {m: max(c, 1) for m, c in k.items()}
        key: Key = (0.0, 0, 0, 0)
        for n in nodes:
            key = _add(key, _node_key(n, x[n.name], scores(n.kind, x[n.name], kpos,
                                                           by_name).value))
        if best is None or better(key, best[0]):
            best = (key, x)
    assert best is not None
    return best[0], _result(nodes, by_name, best[1], scores, "brute force", True, t0)


def placement_key(nodes: Sequence[NodeSpec], models: Sequence[ModelDemand],
                  placement: Placement, scorer: NodeScorer) -> Key:
    """The key of a placement (to compare solvers' answers)."""
    by_name = {m.name: m for m in models}
    scores = _Scores(scorer)
    k = {m: max(placement.total_copies(m), 1) for m in by_name}
    key: Key = (0.0, 0, 0, 0)
    for n in nodes:
        xn = placement.copies.get(n.name, {})
        key = _add(key, _node_key(n, xn, scores(n.kind, xn, k, by_name).value))
    return key


def exact_states(nodes: Sequence[NodeSpec], models: Sequence[ModelDemand]) -> int:
    """How many node configurations `exact` may score (its cost)."""
    per_k = math.prod(sum((j + 1) for j in range(m.max_copies + 1)) for m in models)
    return per_k * len({n.kind for n in nodes})


# -- the greedy and its local search ------------------------------------------------------


class _State:
    """A placement under construction: copies per node, each node's score and key."""

    def __init__(self, nodes: Sequence[NodeSpec], models: dict[str, ModelDemand],
                 scores: _Scores) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.models = models
        self.scores = scores
        self.x: dict[str, dict[str, int]] = {n.name: {} for n in nodes}
        self.k: dict[str, int] = {m: 0 for m in models}
        self.keys: dict[str, Key] = {n.name: (0.0, 0, 0, 0) for n in nodes}
        self.served: dict[str, dict[str, float]] = {n.name: {} for n in nodes}

    def total(self) -> Key:
        key: Key = (0.0, 0, 0, 0)
        for v in self.keys.values():
            key = _add(key, v)
        return key

    def evaluate(self, node: str, x: Mapping[str, int],
                 k: Mapping[str, int]) -> tuple[Key, NodeScore]:
        n = self.nodes[node]
        kpos = {m: max(c, 1) for m, c in k.items()}
        s = self.scores(n.kind, x, kpos, self.models)
        return _node_key(n, x, s.value), s

    def refresh(self, node: str) -> None:
        key, s = self.evaluate(node, self.x[node], self.k)
        self.keys[node] = key
        self.served[node] = dict(s.served)

    def try_change(self, changes: Mapping[str, Mapping[str, int]]) -> Key | None:
        """The total key if node -> {model: new copies} were applied (None: infeasible)."""
        k = dict(self.k)
        newx: dict[str, dict[str, int]] = {}
        for node, upd in changes.items():
            x = dict(self.x[node])
            for m, c in upd.items():
                k[m] += c - x.get(m, 0)
                if c > 0:
                    x[m] = c
                else:
                    x.pop(m, None)
            if not _fits(self.nodes[node], x, self.models):
                return None
            newx[node] = x
        if any(k[m] > self.models[m].max_copies for m in upd_models(changes)):
            return None
        # Nodes whose copies change rate (k changed) are re-scored too.
        touched = set(newx) | {n for n, x in self.x.items()
                               if any(k[m] != self.k[m] for m in x)}
        key = self.total()
        for node in touched:
            x = newx.get(node, self.x[node])
            nk, _ = self.evaluate(node, x, k)
            key = _add(_sub(key, self.keys[node]), nk)
        return key

    def apply(self, changes: Mapping[str, Mapping[str, int]]) -> None:
        before = dict(self.k)
        for node, upd in changes.items():
            for m, c in upd.items():
                self.k[m] += c - self.x[node].get(m, 0)
                if c > 0:
                    self.x[node][m] = c
                else:
                    self.x[node].pop(m, None)
        touched = set(changes) | {n for n, x in self.x.items()
                                  if any(self.k[m] != before[m] for m in x)}
        for node in touched:
            self.refresh(node)

    def shortfall(self, node: str) -> float:
        """Weighted rps the node's copies do not serve of the rate they carry."""
        out = 0.0
        for m, c in self.x[node].items():
            carried = c * self.models[m].rate_rps / max(self.k[m], 1)
            out += self.models[m].weight * max(0.0, carried - self.served[node].get(m, 0.0))
        return out


def upd_models(changes: Mapping[str, Mapping[str, int]]) -> set[str]:
    return {m for upd in changes.values() for m in upd}


def greedy(nodes: Sequence[NodeSpec], models: Sequence[ModelDemand], scorer: NodeScorer, *,
           time_limit_s: float = 5.0) -> Placement:
    """Copies by demand, worst fit (resident nodes first), then local search: move a copy
    of a node that falls short to another node, add a copy of a model served short, move a
    copy home to a node where it is resident; the first move that improves the key is
    taken, until none does or `time_limit_s` is spent."""
    t0 = time.perf_counter()
    by_name = {m.name: m for m in models}
    scores = _Scores(scorer)
    st = _State(nodes, by_name, scores)
    load = {n.name: 0.0 for n in nodes}
    mem = {n.name: 0.0 for n in nodes}

    def demand(m: ModelDemand, node: NodeSpec) -> float:
        return m.demand.get(node.kind, math.inf)

    copies: list[tuple[float, str]] = []  # (device share of one copy, model)
    for m in models:
        runnable = [n for n in nodes if n.kind in m.memory_mb and math.isfinite(demand(m, n))]
        if not runnable or m.max_copies == 0:
            continue
        kc = max(1, min(m.min_copies, m.max_copies))
        copies += [(min(demand(m, n) for n in runnable) / kc, m.name)] * kc
    copies.sort(key=lambda c: (-c[0], c[1]))
    for _, name in copies:
        m = by_name[name]
        kc = max(1, min(m.min_copies, m.max_copies))
        best: tuple[tuple[int, int, float, str], NodeSpec] | None = None
        for n in nodes:
            if n.kind not in m.memory_mb or not math.isfinite(demand(m, n)) or \
                    mem[n.name] + m.memory_mb[n.kind] > n.memory_mb + 1e-9:
                continue
            d = demand(m, n) / kc
            home = 0 if name in n.resident and load[n.name] + d <= 1.0 else 1
            rank = (st.x[n.name].get(name, 0), home, load[n.name] + d, n.name)
            if best is None or rank < best[0]:
                best = (rank, n)
        if best is None:
            continue
        n = best[1]
        st.x[n.name][name] = st.x[n.name].get(name, 0) + 1
        st.k[name] += 1
        load[n.name] += demand(m, n) / kc
        mem[n.name] += m.memory_mb[n.kind]
    for n in nodes:
        st.refresh(n.name)
    _local_search(st, t0 + time_limit_s)
    return _result(nodes, by_name, st.x, scores, "greedy", False, t0)


def _local_search(st: _State, deadline: float) -> None:
    names = list(st.nodes)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        current = st.total()
        for change in _moves(st, names):
            if time.perf_counter() >= deadline:
                return
            got = st.try_change(change)
            if got is not None and better(got, current):
                st.apply(change)
                improved = True
                break


def _moves(st: _State, names: list[str]) -> Iterator[dict[str, dict[str, int]]]:
    """Candidate changes, the most promising first (a generator: the search stops at the
    first that improves)."""
    short = sorted((n for n in names if st.shortfall(n) > 1e-9), key=lambda n: -st.shortfall(n))
    slack = sorted(names, key=lambda n: (st.shortfall(n), sum(st.x[n].values()), n))
    targets = slack[:4]
    for a in short:
        for m, c in sorted(st.x[a].items()):
            md = st.models[m]
            # Another copy of a model served short: on its node or on a roomy one.
            if st.k[m] < md.max_copies and st.served[a].get(m, 0.0) < (
                    c * md.rate_rps / st.k[m]) * (1 - 1e-6):
                yield {a: {m: c + 1}}
                for b in targets:
                    if b != a:
                        yield {b: {m: st.x[b].get(m, 0) + 1}}
            # Move one copy elsewhere.
            for b in targets + [n for n in names if m in st.nodes[n].resident]:
                if b != a:
                    yield {a: {m: c - 1}, b: {m: st.x[b].get(m, 0) + 1}}
            # Swap with a copy on a roomy node.
            for b in targets:
                if b == a:
                    continue
                for m2, c2 in sorted(st.x[b].items()):
                    if m2 != m:
                        yield {a: {m: c - 1, m2: st.x[a].get(m2, 0) + 1},
                               b: {m2: c2 - 1, m: st.x[b].get(m, 0) + 1}}
    # Home moves and dropping copies that do not pay (residency, fewer copies).
    for a in names:
        for m, c in sorted(st.x[a].items()):
            if m not in st.nodes[a].resident:
                for b in names:
                    if b != a and m in st.nodes[b].resident and not st.x[b].get(m):
                        yield {a: {m: c - 1}, b: {m: 1}}
            if st.k[m] > 1:
                yield {a: {m: c - 1}}
    # Models placed nowhere (memory, say): try each node.
    for m, md in st.models.items():
        if st.k[m] == 0 and md.max_copies > 0:
            for b in slack:
                yield {b: {m: 1}}


def place(nodes: Sequence[NodeSpec], models: Sequence[ModelDemand], scorer: NodeScorer, *,
          time_limit_s: float = 5.0, exact_max_states: int = EXACT_MAX_STATES) -> Placement:
    """`exact` when the instance is small enough, else `greedy`."""
    if exact_states(nodes, models) <= exact_max_states and len(nodes) <= 4:
        return exact(nodes, models, scorer)
    return greedy(nodes, models, scorer, time_limit_s=time_limit_s)
