"""Online batch-latency model T(b) = k + t*b (Zhang et al.: the linear GPU-time model).

Seeded from a profile at the worker's slice or from the worker's warm-up timings, then
refined after every batch with an exponentially weighted fit, so refusal decisions and
batch windows use what the worker really does now. Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math

import cython

TRUST_AFTER = 3  # observed batches before an estimate may refuse requests
LOW_RISE = 0.005  # how far the fast-end line rises toward a slower batch, per batch
SLOW_Q = 0.9  # `slow` is this quantile of (observed / estimated) batch time ...
SLOW_STEP = 0.05  # ... tracked by steps of this size (up SLOW_Q, down 1 - SLOW_Q of it)
# The fit's covariance (`_fit`) is in units of the batches' own noise: P_START says a seed
# is known to within about 10x that (a profile or a warm-up on another load), so the first
# batches move the line through them; P_CAP bounds what it grows back to in a direction
# recent batches do not measure (chosen on logged batches of mobilenet_v3_small and
# resnet18 under overload: 0.25 and 1 left batches of 1 at 1.14-1.33x the line and of 3
# at 0.71-0.82x it, 4 and 16 both within 0.93-1.02x).
P_START = 100.0
P_CAP = 4.0
P_RESTART = 2.0  # after two far-off batches running: a step of about 0.7 of the error
N_SCALE = 8.0  # batch sizes are fitted as n / N_SCALE
# A far-off batch is believed, too, when the last far-off one was of the same size, off in
# the same direction, at most FAR_WITHIN batches before, and no batch of that size came
# between that was not far off (`observe`).
FAR_WITHIN = 4


# An extension type when compiled (setup.py): the simulator and the dispatcher ask it on
# every decision.
@cython.dataclasses.dataclass
@cython.cclass
class LinearLatency:
    """`observations` counts the batches seen. A seed (warm-up timings, a profile) is a
    guess: until `TRUST_AFTER` real batches have been observed the estimate is not
    `trusted`, and the runtime does not refuse requests on its word alone; otherwise a
    seed that came out too slow (say, warm-up on a busy machine) would refuse every
    request, so no batch would ever run to correct it.

    `estimate_s` follows the mean (what a batch takes now: batch windows and policies
    plan with it), a line fitted by recursive least squares with forgetting (`_fit`).
    `refusal_s` follows the fast end: the mean line's shape at a level `lo_s` (a batch
    of 1) that drops at once to a faster batch and rises only slowly (`LOW_RISE` per
    batch); it is never above the mean. Refusals use it, so a request is refused only
    when even the speed the model reached recently cannot answer it in time. Without
    it, contention feeds on itself: a slower batch (the machine shared with the very
    clients being refused, who retry at once) raises the estimate, which refuses more,
    which brings more retries.

    `high_s` is the slow end: the mean times `slow`, a running `SLOW_Q` quantile of how
    much longer than the mean batches take (never below 1). It is relative: a machine
    that got slower moves the mean, and `slow` only measures the spread around it. A
    request that waits behind others is admitted on it (`dstack.runtime.dispatch`): a
    queue kept full to the last request the mean would admit answers about half of those
    late, since each is admitted at the margin. One outlier moves it by one step."""

    k_s: cython.double  # fixed cost per batch
    t_s: cython.double  # cost per item
    alpha: cython.double = 0.1  # weight of a new observation
    observations: cython.long = 0
    far_streak: cython.long = 0  # consecutive observations far off in the same direction
    # The last far-off observation: its batch size (0: none pending), direction (+1 slower,
    # -1 faster than the line) and `observations` count then.
    far_n: cython.long = 0
    far_dir: cython.long = 0
    far_at: cython.long = 0
    lo_s: cython.double = -1.0  # the fast end of a batch of 1 (refusal_s); -1: not yet
    slow: cython.double = 1.0  # high_s / estimate_s: see the class docstring
    # The fit's covariance (recursive least squares, in units of the noise): how sure the
    # line is of k_s and t_s, alone and together. p_kk < 0: not started (the seed is a
    # guess, so the first batches move the line most of the way).
    p_kk: cython.double = -1.0
    p_kt: cython.double = 0.0
    p_tt: cython.double = 0.0
    # The size of recent batches, weighted as the fit weighs them (0: none yet): where the
    # line is measured, and so where it is compared with a profile (`typical_n`).
    n_seen: cython.double = 0.0

    @property
    def trusted(self) -> bool:
        return self.observations >= TRUST_AFTER

    @classmethod
    def from_points(cls, b1: int, s1: float, b2: int, s2: float) -> LinearLatency:
        if b2 == b1:
            return cls(max(s1, 1e-6), 0.0)
        t = max(0.0, (s2 - s1) / (b2 - b1))
        k = max(1e-6, s1 - t * b1)
        return cls(k, t)

    def typical_n(self) -> int:
        """The batch size recent batches had (1 before any): the line is measured there,
        and only extrapolated far from it (a batch of one under load, when every batch is
        full, can read several times what one takes)."""
        return max(1, int(self.n_seen + 0.5))

    @cython.ccall
    def estimate_s(self, n: cython.long) -> cython.double:
        return self.k_s + self.t_s * max(n, 1)

    @cython.ccall
    def refusal_s(self, n: cython.long) -> cython.double:
        """What a batch of n takes at the fast end of recent batches (see the class
        docstring); refusals use it."""
        mean: cython.double = self.estimate_s(n)
        if self.lo_s < 0:
            return mean
        lo: cython.double = self.lo_s * mean / self.estimate_s(1)
        return lo if lo < mean else mean

    @cython.ccall
    def high_s(self, n: cython.long) -> cython.double:
        """What a batch of n takes at the slow end of recent batches (see the class
        docstring): admission reads it for a request that waits behind others."""
        return self.estimate_s(n) * self.slow

    @cython.cfunc
    def _observe_low(self, n: cython.long, seconds: cython.double) -> cython.void:
        if self.lo_s < 0:
            return  # split off in `observe`, from the seed, before its first batch
        # the batch's time as a batch of 1 would have taken it, by the mean line's shape
        one: cython.double = seconds * self.estimate_s(1) / self.estimate_s(n)
        err: cython.double = one - self.lo_s
        self.lo_s = max(1e-6, self.lo_s + (0.5 if err < 0 else LOW_RISE) * err)

    @cython.cfunc
    def _fit(self, n: cython.long, err: cython.double, restart: cython.bint) -> cython.void:
        """One step of recursive least squares on (1, n) -> seconds, forgetting at
        1 - alpha a batch: batches of several sizes pin both the fixed and the per-item
        cost, where an error split by their shares of the prediction keeps the line's
        proportions (a line seeded through the origin stayed there, and overestimated
        big batches by half while it matched batches of 1). Worked in (1, n / N_SCALE),
        where both costs are of one size, so that the covariance can be bounded alike."""
        if self.p_kk < 0:  # the seed is a guess: the first batch moves the line to it
            self.p_kk, self.p_kt, self.p_tt = P_START, 0.0, P_START
        elif restart:  # far off twice running: believed, most of the way (about 0.7)
            self.p_kk, self.p_kt, self.p_tt = P_RESTART, 0.0, P_RESTART
        z: cython.double = max(n, 1) / N_SCALE
        lam: cython.double = 1.0 - self.alpha
        px_k: cython.double = self.p_kk + self.p_kt * z  # P x
        px_t: cython.double = self.p_kt + self.p_tt * z
        denom: cython.double = lam + px_k + px_t * z
        g_k: cython.double = px_k / denom
        g_t: cython.double = px_t / denom
        # The per-item cost is never negative, a batch of 1 never free; the fixed cost
        # may be (a CPU model whose batch of 1 runs relatively well: resnet18 on one core
        # takes 28 ms for 1 and 35 ms more per item), where clamping it at 0 left the
        # fit pushing against the clamp, 1% of the way a batch.
        self.t_s = max(0.0, self.t_s + g_t * err / N_SCALE)
        self.k_s = max(1e-6 - self.t_s, self.k_s + g_k * err)
        self.p_kk = (self.p_kk - g_k * px_k) / lam
        self.p_kt = (self.p_kt - g_k * px_t) / lam
        self.p_tt = (self.p_tt - g_t * px_t) / lam
        # Batches all of one size leave the other direction unmeasured, where forgetting
        # alone would grow the covariance without bound: its largest eigenvalue is kept
        # within P_CAP (a rare batch of another size then moves the line part of the way
        # to it, not all of it), the measured direction untouched.
        half: cython.double = 0.5 * (self.p_kk + self.p_tt)
        disc: cython.double = math.sqrt(0.25 * (self.p_kk - self.p_tt) ** 2 + self.p_kt ** 2)
        top: cython.double = half + disc
        if top > P_CAP:
            v_k: cython.double = self.p_kt
            v_t: cython.double = top - self.p_kk
            if abs(v_k) + abs(v_t) < 1e-300:  # diagonal, p_kk the larger
                v_k, v_t = 1.0, 0.0
            norm: cython.double = v_k * v_k + v_t * v_t
            cut: cython.double = (top - P_CAP) / norm
            self.p_kk -= cut * v_k * v_k
            self.p_kt -= cut * v_k * v_t
            self.p_tt -= cut * v_t * v_t

    @cython.cfunc
    def _nudge(self, n: cython.long, step: cython.double) -> cython.void:
        """Move the line by `step` seconds at n along the fit's gain (P x), the
        covariance untouched: the line moves where the batches it has seen leave it
        free, but never more than `step` at n, even at a size recent batches do not
        measure (a fit step there would move it most of the way to the outlier).
        Scaling the whole line instead ran away: on a line with a negative fixed cost
        each outlier at batch 1 scaled both costs up and the fit then took the rise back
        through the fixed cost alone, so 5,000 batches of 1 left a batch of 8 read at
        112 s against 0.5 ms for 1 (docs/decisions.md)."""
        z: cython.double = max(n, 1) / N_SCALE
        px_k: cython.double = 1.0  # not started (only probes so far): P is the identity
        px_t: cython.double = z
        if self.p_kk >= 0:
            px_k = self.p_kk + self.p_kt * z
            px_t = self.p_kt + self.p_tt * z
        xpx: cython.double = px_k + px_t * z
        if xpx <= 0:
            return
        self.t_s = max(0.0, self.t_s + px_t * step / xpx / N_SCALE)
        self.k_s = max(1e-6 - self.t_s, self.k_s + px_k * step / xpx)

    @cython.ccall
    def observe(self, n: cython.long, seconds: cython.double) -> cython.void:
        """Move the line toward an observed (n, seconds) point (`_fit`)."""
        pred: cython.double = self.estimate_s(n)
        err: cython.double = seconds - pred
        if self.lo_s < 0:  # the fast end starts at the seed (a profile, a warm-up)
            self.lo_s = self.estimate_s(1)
        self.observations += 1
        self.n_seen = n if self.n_seen <= 0 else self.n_seen + self.alpha * (n - self.n_seen)
        if pred <= 0:
            return
        if self.observations > TRUST_AFTER:  # the seed's own error is not spread
            if seconds > pred * self.slow:
                self.slow += SLOW_STEP * SLOW_Q
            else:
                self.slow = max(1.0, self.slow - SLOW_STEP * (1 - SLOW_Q))
        # Far off (more than 2x either way): believed only when it happens twice in a row
        # in the same direction, or twice at one batch size with only other sizes between
        # (`FAR_WITHIN`), or while the estimate is still a seed; then the line moves most
        # of the way at once. A lone outlier (a stall on a busy machine) moves it as a 2x
        # observation would: it cannot flip refusals on its own. The second rule is for a
        # line that is wrong at one size while right at another: batches of 1 and 2 taking
        # 9 and 11 ms, alternating, against a line through 4 and 14 ms. Each batch of 1
        # came out far off and was a lone outlier, whose scaling of a line with a negative
        # fixed cost made it steeper, while the fit at 2 held it there: the line ran away
        # to 0 and 86 ms in 80 batches, and admission then refused every request that
        # would wait behind another (measured under overload, docs/decisions.md).
        far: cython.long = 0
        if seconds > 2 * pred:
            far = 1
        elif seconds < 0.5 * pred:
            far = -1
        again: cython.bint = (far != 0 and n == self.far_n and far == self.far_dir
                              and self.observations - self.far_at <= FAR_WITHIN)
        if far == 0:
            self.far_streak = 0
            if n == self.far_n:
                self.far_n = 0
        else:
            if (far > 0) == (self.far_streak > 0) and self.far_streak != 0:
                self.far_streak += far
            else:
                self.far_streak = far
            self.far_n, self.far_dir, self.far_at = n, far, self.observations
        restart: cython.bint = far != 0 and (abs(self.far_streak) >= 2 or again)
        if far != 0 and not restart and self.observations > TRUST_AFTER:
            # A lone outlier moves the line at n by `alpha` of the way to a 2x (or 0.5x)
            # batch, in the direction a fit step would (`_nudge`).
            self._nudge(n, self.alpha * (1.0 if far > 0 else -0.5) * pred)
        else:
            self._fit(n, err, restart)
        self._observe_low(n, seconds)

    @cython.ccall
    def remeasure(self, n: cython.long, seconds: cython.double) -> cython.void:
        """A probe's measurement (the estimate was refusing requests): the mean line is
        moved to pass through it at once (`_nudge`, the whole way); the fast end follows
        as after any batch. Scaling both costs instead ran away as lone outliers did:
        a probe 1.5x slow followed by 20 batches at the line, 20 times over, read a
        batch of 8 at 15 s on a line with a negative fixed cost."""
        pred: cython.double = self.estimate_s(n)
        self.observations += 1
        self.far_streak = 0
        if pred > 0 and seconds > 0:
            self._nudge(n, seconds - pred)
            self._observe_low(n, seconds)  # a faster probe lowers the fast end at once

    def max_batch_within(self, budget_s: float, cap: int) -> int:
        """Largest n <= cap with estimate_s(n) <= budget_s (0 when even n=1 does not fit)."""
        if self.estimate_s(1) > budget_s:
            return 0
        if self.t_s <= 0:
            return cap
        return max(1, min(cap, int((budget_s - self.k_s) / self.t_s)))
