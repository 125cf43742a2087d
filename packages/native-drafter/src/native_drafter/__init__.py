"""Training and native kernels for the DSpark drafter, each fast path held to a readable
reference by one fidelity gate (comparison.py)."""
