"""The name the drafter-tp2 test modules import their helpers by; they live in
drafter_tp2.testing, which benchmarks/cpu_check.py imports too."""

from drafter_tp2.testing import PairProcess, RankPair, drafter_tp2, tp2_env, worker_args

__all__ = ["PairProcess", "RankPair", "drafter_tp2", "tp2_env", "worker_args"]
