"""The two-card tensor-parallel DSpark drafter worker (issue 10)."""
