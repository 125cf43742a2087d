"""The fidelity gate: a fast GPU path is held to its readable reference.

Quantities (a loss, logits, every gradient; each native kernel stage's output)
are compared as relative errors, ||fast - ref|| / ||ref|| in float64, each against the
tolerance stated for its name (the longest matching prefix in the table). Anything
non-finite, missing, of another shape, or without a stated tolerance fails: the gate never
passes by omission. One module for the training fast path and the native kernels: both
are "fast paths held to a reference", and one gate keeps one meaning of "matches".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch


class GateFailed(RuntimeError):
    """The fast path does not match its reference: nothing it produced may be kept."""

    def __init__(self, report: GateReport):
        self.report = report
        bad = [c for c in report.checks if not c.passed]
        super().__init__(f"fidelity gate failed on {len(bad)} of {len(report.checks)} checks: "
                         + "; ".join(f"{c.name} ({c.why})" for c in bad[:6]))


@dataclass(frozen=True)
class Check:
    name: str
    error: float        # relative error (inf when non-finite, missing or mis-shaped)
    tolerance: float
    why: str = ""

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance


@dataclass
class GateReport:
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def worst(self, prefix: str = "") -> Check:
        return max((c for c in self.checks if c.name.startswith(prefix)),
                   key=lambda c: c.error / c.tolerance)

    def raise_for_failure(self) -> GateReport:
        if not self.passed:
            raise GateFailed(self)
        return self

    def to_json(self) -> dict:
        return {"passed": self.passed, "checks": [{**asdict(c), "passed": c.passed} for c in self.checks]}

    def table(self, prefixes: tuple[str, ...]) -> str:
        """One line per quantity family: its worst check against its tolerance."""
        lines = [f"{'quantity':<34} {'rel. error':>11} {'tolerance':>10}  result"]
        for p in prefixes:
            c = self.worst(p)
            lines.append(f"{c.name[:34]:<34} {c.error:>11.3e} {c.tolerance:>10.1e}  "
                         f"{'ok' if c.passed else 'FAIL ' + c.why}")
        return "\n".join(lines)


def relative_error(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[float, str]:
    if candidate.shape != reference.shape:
        return float("inf"), f"shape {tuple(candidate.shape)} != {tuple(reference.shape)}"
    a, b = candidate.detach().double().cpu(), reference.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf"), "non-finite values in the fast path"
    if not torch.isfinite(b).all():
        return float("inf"), "non-finite values in the reference"
    norm = b.norm().item()
    diff = (a - b).norm().item()
    if norm == 0.0:
        return (0.0, "") if diff == 0.0 else (float("inf"), "reference is zero")
    return diff / norm, ""


def tolerance_for(name: str, tolerances: dict[str, float]) -> float | None:
    matches = [p for p in tolerances if name.startswith(p)]
    return tolerances[max(matches, key=len)] if matches else None


def compare(reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor],
            tolerances: dict[str, float], label: str = "") -> GateReport:
    """Every reference quantity against the candidate's, by name."""
    checks = []
    for name, ref in reference.items():
        full = f"{label}{name}"
        tol = tolerance_for(name, tolerances)
        if tol is None:
            checks.append(Check(full, float("inf"), 0.0, "no tolerance stated for it"))
            continue
        if name not in candidate:
            checks.append(Check(full, float("inf"), tol, "missing from the fast path"))
            continue
        error, why = relative_error(candidate[name], ref)
        if not why and error > tol:
            why = f"{error / tol:.1f}x the tolerance"
        checks.append(Check(full, error, tol, why))
    for name in candidate.keys() - reference.keys():
        checks.append(Check(f"{label}{name}", float("inf"), 0.0, "not in the reference"))
    return GateReport(checks)


def merge(reports: list[GateReport]) -> GateReport:
    return GateReport([c for r in reports for c in r.checks])


def write(report: GateReport, path: str, **extra) -> None:
    with open(path, "w") as f:
        json.dump({**report.to_json(), **extra}, f, indent=1)
