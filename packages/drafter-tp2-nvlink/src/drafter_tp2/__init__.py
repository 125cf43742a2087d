"""The two-card tensor-parallel DSpark drafter worker."""
