"""Training and (issue 12) native kernels for the DSpark drafter, each fast path held to a
readable reference by one fidelity gate (gate.py)."""
