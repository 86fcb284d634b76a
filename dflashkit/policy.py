"""How many drafted tokens to verify at each step: the count that maximises expected
committed tokens per second, from the target's measured cost curve and the drafter's running
acceptance.

With ``r_k`` the probability that the first k drafted tokens are all accepted, verifying n
drafted tokens commits ``E(n) = 1 + r_1 + ... + r_n`` tokens on average (the bonus token
always) and costs ``verify(n + 1) + draft`` (no draft when n = 0). The policy picks
``argmax_n E(n) / cost(n)``. Which tokens are verified never changes what is committed, so
every choice is lossless; only the speed depends on it.

Acceptance is observed retroactively: the drafter proposes its whole block on every 4th
step (else only the slots to verify), and once the committed text reaches past a proposal we
know how far it would have matched, whether or not those slots were verified. So the estimates for long prefixes keep improving even while
the policy verifies few tokens, and a policy that verifies nothing still drafts now and
then to keep learning.

Costs are learned too (``OnlineCost``): the curve measured at start-up (KV 256, an idle
machine) is corrected by the pass times the loop actually observes, so a longer context, a
busier machine or per-row work the benchmark did not see moves the choice.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from .costs import CostCurve


@dataclass
class OnlineCost:
    """The measured curve corrected by two numbers fitted to every observed pass: a
    machine-wide scale and an extra cost per verified row.

    The scale is a decayed mean of observed/curve ratios (1, the curve, as its prior). The
    extra per-row cost comes from PAIRS of consecutive passes over different row counts (the
    loop's one-draft-fewer explorations and its changes of mind): a pass and the one just
    before it ran ~0.1 s apart, so the machine's load, which drifts over seconds on a shared
    CPU, cancels in their difference, and only the rows they differ by remain. It is a
    median of the last pairs' slopes (a pass slowed by another process moves a median of many
    pairs by one place, not by its size), less its standard error, and never negative: the
    curve stands until the passes show it wrong beyond their noise. A regression on the
    passes themselves (the design before) took that drift for a per-row cost; clipped at zero,
    the noise then biased the choice to fewer drafts (4.33 per step on average in one run on
    the AMD EPYC, where 4 to 6 rows cost the same and the ideal is 4.9; simulated in
    tests/test_policy.py). Pooling all passes into two numbers, rather than a correction per
    q, keeps the choice steady on a noisy machine:
    a separate correction per q lets whichever q happened to get a fast pass look cheapest.
    A negative extra cost is noise by construction, since the curve was timed on an idle
    machine at the shortest context the loop sees: load scales every pass, and a longer
    context only adds per-row attention work.
    """

    curve: CostCurve
    prior_weight: float = 4.0     # pseudo-observations behind the scale's prior
    decay: float = 0.95           # weight left to an observation after each newer one
    slope_window: int = 201       # pairs in the median (~800 passes at one exploration in 8)
    _scale: list[float] = field(default_factory=list)    # [sum, weight, prior weight]
    _where: list[float] = field(default_factory=list)    # the x the scale was fitted at
    _draft: list[float] = field(default_factory=list)
    _slopes: deque = field(default_factory=deque)         # the last pairs' dy/dx, ms per row
    _last: tuple[float, float] | None = None             # (x, y) of the previous pass
    _slope: float | None = None                          # extra_ms_per_row, cached

    def __post_init__(self):
        self._scale = self._scale or self._fresh()
        self._where = self._where or [0.0, 0.0, 0.0]
        self._draft = self._draft or self._fresh()

    def _fresh(self) -> list[float]:
        return [0.0, 0.0, self.prior_weight]

    def _add(self, acc: list[float], value: float) -> None:
        acc[0] = acc[0] * self.decay + value
        acc[1] = acc[1] * self.decay + 1.0
        acc[2] = acc[2] * self.decay

    @staticmethod
    def _mean(acc: list[float], prior: float) -> float:
        return (acc[2] * prior + acc[0]) / (acc[2] + acc[1])

    def _rows(self, q: int) -> float:
        """The regressor: extra rows over the curve's cost, so the slope is in ms per row."""
        return (q - 1) / self.curve.verify(q)

    def observe_verify(self, tokens: int, ms: float) -> None:
        if tokens < 1 or not ms > 0:
            return
        x, y = self._rows(tokens), ms / self.curve.verify(tokens)
        if self._last is not None and abs(x - self._last[0]) > 1e-9 * abs(x):
            self._slopes.append((y - self._last[1]) / (x - self._last[0]))
            if len(self._slopes) > self.slope_window:
                self._slopes.popleft()
            self._slope = None          # recomputed when next asked (a pair every ~4 passes)
        self._last = (x, y)
        self._add(self._scale, y)
        self._add(self._where, x)

    def observe_draft(self, ms: float) -> None:
        if ms > 0:
            self._add(self._draft, ms)

    def machine_ratio(self) -> float:
        return self._mean(self._scale, 1.0)

    def extra_ms_per_row(self) -> float:
        """The median pair slope less its standard error (from the median absolute
        deviation): the curve stands until the passes show it wrong beyond their noise."""
        if self._slope is None:
            n, slope = len(self._slopes), 0.0
            if n >= 3:
                med = statistics.median(self._slopes)
                mad = statistics.median([abs(v - med) for v in self._slopes])
                slope = max(med - 1.86 * mad / n ** 0.5, 0.0)   # 1.86 = 1.2533 * 1.4826
            self._slope = slope
        return self._slope

    def verify(self, q: int) -> float:
        x_sum, weight = self._where[0], self._where[1]    # the scale holds where the recent
        centre = x_sum / weight if weight else 0.0       # passes were
        ratio = self.machine_ratio() + self.extra_ms_per_row() * (self._rows(q) - centre)
        return self.curve.verify(q) * max(ratio, 1e-3)

    @property
    def draft_ms(self) -> float:
        return self._mean(self._draft, self.curve.draft_ms * self.machine_ratio())


def expected_tokens(prefix_rates: list[float], n: int) -> float:
    """E(n) = 1 + sum of P(first k accepted) for k = 1..n."""
    return 1.0 + sum(prefix_rates[:n])


def best_num_drafts(prefix_rates: list[float], curve: CostCurve | OnlineCost, max_drafts: int,
                    rows: int = 1) -> int:
    """The n in 0..max_drafts with the highest expected committed tokens per millisecond.

    ``rows``: requests verified together (batch.py); a pass over rows x (n + 1) tokens costs
    about what one row of that many tokens does, since the weights are read once."""
    best, best_rate = 0, 1.0 / curve.verify(rows)
    for n in range(1, max_drafts + 1):
        rate = expected_tokens(prefix_rates, n) / (curve.verify(rows * (n + 1)) + rows * curve.draft_ms)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best


@dataclass
class AdaptiveBlockSize:
    """Running acceptance statistics plus the cost curve; reusable across requests."""

    curve: CostCurve
    max_drafts: int
    prior_weight: float = 4.0     # pseudo-observations behind the prior
    acceptance_decay: float = 0.99  # weight left to an acceptance observation after each newer
                                    # one (~100 steps of memory): acceptance is a property of
                                    # the text being written, so a new kind of request (code,
                                    # then chat) must move the choice within one answer
    explore_every: int = 4        # when verifying nothing, still draft every N-th step
    learn_costs: bool = True      # correct the curve with observed pass times (OnlineCost)
    explore_costs_every: int = 8  # every N-th choice verifies one draft fewer than the best n,
                                  # so the learned costs can reveal a curve whose slope is wrong
    propose_all_every: int = 4    # the drafter's head scores every slot (for the statistics of
                                  # slots not verified) on every N-th drafting step, else only
                                  # the verified ones: 2 more head rows cost ~0.7 ms a step on
                                  # the AMD EPYC (its kernels block rows by 6), ~0.7% of a step
    matched: list[float] = field(default_factory=list)    # [k]: first k+1 proposals all matched
    observed: list[float] = field(default_factory=list)   # [k]: observations reaching slot k+1
    prior: list[float] = field(default_factory=list)
    _idle_steps: int = 0
    _choices: int = 0
    _proposals: int = 0
    costs: OnlineCost | None = None

    def __post_init__(self):
        problems = [what for bad, what in (
            (not isinstance(self.max_drafts, int) or self.max_drafts < 1, "max_drafts must be >= 1 "
             "(a drafter of block size 1 drafts nothing; use block_size=1 for plain decoding)"),
            (not self.prior_weight >= 0, "prior_weight must be >= 0"),
            (not 0 < self.acceptance_decay <= 1, "acceptance_decay must be in (0, 1]"),
            (self.explore_every < 1, "explore_every must be >= 1"),
            (self.explore_costs_every < 0, "explore_costs_every must be >= 0 (0: never)"),
            (self.propose_all_every < 1, "propose_all_every must be >= 1 (1: every step)"),
            (bool(self.prior) and len(self.prior) != self.max_drafts,
             f"prior needs one rate per draft slot ({self.max_drafts})")) if bad]
        if problems:
            raise ValueError("AdaptiveBlockSize: " + "; ".join(problems))
        if self.costs is None:
            self.costs = OnlineCost(self.curve)
        if not self.prior:
            self.prior = [0.5 ** (k + 1) for k in range(self.max_drafts)]
        self.matched = self.matched or [0.0] * self.max_drafts
        self.observed = self.observed or [0.0] * self.max_drafts

    def prefix_rates(self) -> list[float]:
        rates, last = [], 1.0
        for k in range(self.max_drafts):
            weight = self.observed[k] + self.prior_weight
            r = (self.matched[k] + self.prior_weight * self.prior[k]) / weight if weight > 0 \
                else self.prior[k]    # no prior weight and nothing observed yet
            last = min(last, r)      # P(first k+1 accepted) cannot grow with k
            rates.append(last)
        return rates

    def num_drafts(self, remaining: int, rows: int = 1) -> int:
        """Drafted tokens to verify this step (``remaining`` new tokens still allowed)."""
        costs = self.costs if self.learn_costs else self.curve
        n = best_num_drafts(self.prefix_rates(), costs, self.max_drafts, rows)
        self._choices += 1
        if self.learn_costs and self.explore_costs_every and self._choices % self.explore_costs_every == 0:
            # One draft fewer (more only from 0): either neighbour shows the learned per-row
            # cost, which is never negative, so going up teaches nothing going down does not,
            # and going up can cross a kernel step (7 rows cost 15% more than 6 on one CPU).
            n = n - 1 if n > 0 else 1
        return max(min(n, remaining - 1), 0)

    def proposal_width(self, num_drafts: int) -> int:
        """Slots the drafter should score this step: the verified ones, and all of them every
        ``propose_all_every``-th time (and whenever none is verified: that draft is only for
        the statistics). Acceptance is observed on whatever was proposed."""
        self._proposals += 1
        if num_drafts == 0 or self._proposals % self.propose_all_every == 0:
            return self.max_drafts
        return num_drafts

    def observe_costs(self, verify_tokens: int, verify_s: float, draft_s: float | None = None) -> None:
        """Wall time of one verify pass over ``verify_tokens`` tokens, and of one drafter pass."""
        self.costs.observe_verify(verify_tokens, verify_s * 1e3)
        if draft_s is not None:
            self.costs.observe_draft(draft_s * 1e3)

    def should_draft(self, num_drafts: int) -> bool:
        """Draft even when verifying none, every ``explore_every`` steps, to keep observing."""
        if num_drafts > 0:
            self._idle_steps = 0
            return True
        self._idle_steps += 1
        return self._idle_steps % self.explore_every == 0

    def observe(self, proposals: list[int], actual: list[int]) -> None:
        """``actual``: the committed tokens at the proposals' positions (may be shorter).
        Only the slots observed here decay: a slot scored on every 4th step keeps as many
        observations of itself as one scored on every step."""
        prefix_ok = True
        decay = self.acceptance_decay
        for k, (p, a) in enumerate(zip(proposals[:self.max_drafts], actual)):
            prefix_ok = prefix_ok and p == a
            self.observed[k] = self.observed[k] * decay + 1
            self.matched[k] = self.matched[k] * decay + prefix_ok
