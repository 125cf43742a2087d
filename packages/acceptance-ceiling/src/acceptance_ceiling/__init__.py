"""acceptance_ceiling: the expected number of drafts a target accepts per round, computed
from the distributions (exact where it can be, Monte Carlo with a confidence interval
where it cannot), the same for an oracle drafter (the ceiling), and the speedup a round
cost model predicts. Rule: ARCHITECTURE.md § DSpark verification."""

__version__ = "0.1.0"
