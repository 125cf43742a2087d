"""Whether the worker may serve an EXL3 pack: only once the fidelity gate
(models.fidelity_gate) recorded a pass for exactly the weights it loads, on rounds of the
target it serves. Checked twice: the record alone before loading (a missing or failed gate
costs no load), the loaded weights' digests after. `--ungated` serves a refused pack for
measuring only: logged, and said in the ready line and in status. Torch-free at import."""

from __future__ import annotations

import logging

from remote_drafter.models.fidelity_gate import (
    GATE_FILE,
    GOAL,
    MIN_ROUNDS,
    changed_modules,
    pack_formats,
    read_record,
    summary,
    weights_of,
)
from remote_drafter.models.registry import spec_folder, worker_side

log = logging.getLogger("remote_drafter.worker")


class Refused(ValueError):
    """The worker must not start: one line saying why."""


def before_loading(spec: str, weights: str, device: str, ungated_ok: bool) -> str | None:
    """Before the card is locked: why the pack has not passed (None: it has, or the weights
    are dense). Refused unless `ungated_ok` (meaningful with exl3 weights only, which the CLI
    checks); a pack served as dense weights is always refused (it would skip its gate)."""
    folder = spec_folder(spec)
    exl3 = worker_side("remote_drafter.models.exl3", "the worker")
    if weights != "exl3":
        if exl3.is_pack(folder):
            raise Refused(f"{folder} holds EXL3 weights: serve it with --weights exl3 (which "
                          "checks its fidelity gate)")
        return None
    exl3.require_pack(folder, device)
    why = refusal(folder, None)
    if why and not ungated_ok:
        raise Refused(why)
    return why


def after_loading(spec: str, drafter, served_target: bool, ungated_ok: bool) -> None:
    """Once loaded: the record must name these very weights (and this target's rounds);
    what status and the handshake say of the gate goes into drafter.serving_notes."""
    manifest = drafter.manifest()
    why = refusal(spec_folder(spec), weights_of(manifest), manifest.target if served_target else None)
    if why and not ungated_ok:
        raise Refused(why)
    if why:
        log.warning("serving an EXL3 pack that has not passed the fidelity gate (--ungated: for "
                    "measuring it, never in production): %s", why)
    drafter.serving_notes = {"exl3_gate": f"UNGATED: {why}" if why else "passed"}


def refusal(pack: str, drafter_digest: str | None, target_digest: str | None = None,
            goal: float = GOAL) -> str | None:
    """Why `pack` may not be served (one line), or None. drafter_digest None: the record
    alone (before the drafter is loaded); target_digest: compared where the record has one.
    The bar is `goal` whatever the record's own goal was: a gate run with a lower --goal
    measures, it does not clear a pack for serving."""
    try:
        rec = read_record(pack)
    except (OSError, ValueError) as exc:
        return f"{pack}: its fidelity gate record ({GATE_FILE}) is unreadable: {exc}"
    if rec is None:
        return (f"{pack} has no fidelity gate record ({GATE_FILE}): run `remote-drafter exl3 gate "
                f"{pack} --reference <its dense drafter> --rounds <gate rounds file>` first")
    try:
        if rec["rounds"] < MIN_ROUNDS:
            return (f"{pack}'s fidelity gate ran on {rec['rounds']} rounds, fewer than the "
                    f"{MIN_ROUNDS} that make a pass more than luck: run it again on more")
        ratio = rec["acceptance_ratio"]
        if ratio is None or ratio < goal or not rec["passed"]:
            return f"{pack} failed the fidelity gate: {summary({**rec, 'goal': max(goal, rec['goal'])})}"
    except (KeyError, TypeError) as exc:
        return f"{pack}: its fidelity gate record ({GATE_FILE}) is incomplete ({exc!r}): run the gate again"
    if "modules" in rec and (changed := changed_modules(rec["modules"], pack_formats(pack))):
        return (f"{pack} holds modules quantised otherwise than its fidelity gate measured ({changed}): "
                "run the gate again on the pack as it is")
    if rec.get("drafter") == rec.get("reference_drafter"):
        return f"{pack} was gated against its own weights: gate it against its dense drafter"
    if drafter_digest is not None and rec.get("drafter") != drafter_digest:
        return (f"{pack}'s fidelity gate record is for drafter {str(rec.get('drafter'))[:12]}, "
                f"the pack loads as {drafter_digest[:12]}: its weights changed since; run the gate again")
    if target_digest and rec.get("target") and rec["target"] != target_digest:
        return (f"{pack}'s fidelity gate ran on target {rec['target'][:12]}'s rounds, this worker "
                f"serves target {target_digest[:12]}: run the gate with rounds of this target")
    return None
