"""How many drafted tokens to verify at each step: the count that maximises expected
committed tokens per second, from the target's measured cost curve and the drafter's running
acceptance.

With ``r_k`` the probability that the first k drafted tokens are all accepted, verifying n
drafted tokens commits ``E(n) = 1 + r_1 + ... + r_n`` tokens on average (the bonus token
always) and costs ``verify(n + 1) + draft`` (no draft when n = 0). The policy picks
``argmax_n E(n) / cost(n)``. Which tokens are verified never changes what is committed, so
every choice is lossless; only the speed depends on it.

Acceptance is observed retroactively: the drafter always proposes its whole block, and once
the committed text reaches past a proposal we know how far it would have matched, whether or
not those slots were verified. So the estimates for long prefixes keep improving even while
the policy verifies few tokens, and a policy that verifies nothing still drafts now and
then to keep learning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import CostCurve


def expected_tokens(prefix_rates: list[float], n: int) -> float:
    """E(n) = 1 + sum of P(first k accepted) for k = 1..n."""
    return 1.0 + sum(prefix_rates[:n])


def best_num_drafts(prefix_rates: list[float], curve: CostCurve, max_drafts: int,
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
    explore_every: int = 4        # when verifying nothing, still draft every N-th step
    matched: list[float] = field(default_factory=list)    # [k]: first k+1 proposals all matched
    observed: list[float] = field(default_factory=list)   # [k]: observations reaching slot k+1
    prior: list[float] = field(default_factory=list)
    _idle_steps: int = 0

    def __post_init__(self):
        if not self.prior:
            self.prior = [0.5 ** (k + 1) for k in range(self.max_drafts)]
        self.matched = self.matched or [0.0] * self.max_drafts
        self.observed = self.observed or [0.0] * self.max_drafts

    def prefix_rates(self) -> list[float]:
        rates, last = [], 1.0
        for k in range(self.max_drafts):
            r = (self.matched[k] + self.prior_weight * self.prior[k]) / (
                self.observed[k] + self.prior_weight)
            last = min(last, r)      # P(first k+1 accepted) cannot grow with k
            rates.append(last)
        return rates

    def num_drafts(self, remaining: int, rows: int = 1) -> int:
        """Drafted tokens to verify this step (``remaining`` new tokens still allowed)."""
        n = min(best_num_drafts(self.prefix_rates(), self.curve, self.max_drafts, rows), remaining - 1)
        return max(n, 0)

    def should_draft(self, num_drafts: int) -> bool:
        """Draft even when verifying none, every ``explore_every`` steps, to keep observing."""
        if num_drafts > 0:
            self._idle_steps = 0
            return True
        self._idle_steps += 1
        return self._idle_steps % self.explore_every == 0

    def observe(self, proposals: list[int], actual: list[int]) -> None:
        """``actual``: the committed tokens at the proposals' positions (may be shorter)."""
        prefix_ok = True
        for k, (p, a) in enumerate(zip(proposals[:self.max_drafts], actual)):
            prefix_ok = prefix_ok and p == a
            self.observed[k] += 1
            self.matched[k] += prefix_ok
