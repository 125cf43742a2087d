"""The fidelity gate of an EXL3 drafter: a drafter that fails it is not served. The
quantised drafter (the candidate) and its dense original (the reference) draft from the
same recorded rounds of the target; the candidate passes when its mean accepted length
under greedy verification is at least GOAL of the reference's. The result is
recorded in the pack folder (GATE_FILE) and the worker serves a pack only while that record
passed for exactly the drafter it loaded (worker.exl3_admission).

Torch-free at import (torch and safetensors are imported where used): reading a record, as
the worker's early check and a launcher do, needs neither.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from remote_drafter.engine.identity import sha256_file

from .base import DraftRequest

GATE_FILE = "exl3-gate.json"  # not exl3.json: packs from exllamav3's own converter have none
GOAL = 0.97                   # a pack keeps >= 97% of its dense drafter's acceptance
MIN_ROUNDS = 32               # fewer rounds pass or fail by luck: one round moves the ratio > 3%
TAPS_KEY = "taps_of"          # the rounds file's metadata: the target layers its taps are
FORMAT = 1
TARGET_KEY = "target_digest"  # the rounds file's metadata: the target the rounds came from


@dataclass
class Round:
    """One recorded round of the target: the drafter is asked to continue `prefix` (the
    anchor last, at position t = len(prefix) - 1) from `taps`, the target's tap rows of the
    positions t - n .. t - 1 (n = min(t, window); None for a token-only drafter);
    `continuation` is what the target itself decoded greedily at t + 1 .. t + depth."""

    taps: np.ndarray | None
    prefix: np.ndarray
    continuation: np.ndarray


# -- the rounds file -----------------------------------------------------------------------

def write_rounds(path: str, rounds: list[Round], target_digest: str | None = None,
                 extra: dict[str, np.ndarray] | None = None, hidden_layers=None) -> None:
    """Rounds as safetensors: taps.{i} float16 [n, feature], prefix.{i} int64 [t + 1],
    continuation.{i} int64 [depth]; `extra` tensors ride along (readers skip them).
    hidden_layers: the target layers the taps are (a drafter tapping others cannot use them)."""
    from safetensors.numpy import save_file
    tensors = dict(extra or {})
    for i, r in enumerate(rounds):
        if r.taps is not None:
            tensors[f"taps.{i}"] = np.ascontiguousarray(r.taps, np.float16)
        tensors[f"prefix.{i}"] = np.ascontiguousarray(r.prefix, np.int64)
        tensors[f"continuation.{i}"] = np.ascontiguousarray(r.continuation, np.int64)
    meta = {"format": str(FORMAT), "rounds": str(len(rounds))}
    if target_digest:
        meta[TARGET_KEY] = target_digest
    if hidden_layers is not None:
        meta[TAPS_KEY] = json.dumps([int(x) for x in hidden_layers])
    save_file(tensors, path, metadata=meta)


def taps_refusal(meta: dict[str, str], drafter) -> str | None:
    """Why rounds recorded with `meta` cannot gate `drafter` (its taps are other layers)."""
    if TAPS_KEY not in meta or not drafter.feature:
        return None
    recorded = json.loads(meta[TAPS_KEY])
    if recorded != [int(x) for x in drafter.hidden_layers]:
        return (f"the rounds hold taps of target layers {recorded}, this drafter reads layers "
                f"{list(drafter.hidden_layers)}: record them with a worker serving this drafter")
    return None


def read_rounds(path: str) -> tuple[list[Round], dict[str, str]]:
    """(rounds, the file's metadata); other tensors in the file are left alone."""
    from safetensors import safe_open
    with safe_open(path, framework="np") as f:
        names, meta = set(f.keys()), dict(f.metadata() or {})
        count = sum(1 for n in names if n.startswith("prefix."))
        rounds = []
        for i in range(count):
            if f"prefix.{i}" not in names or f"continuation.{i}" not in names:
                raise ValueError(f"{path}: round {i} lacks its prefix or continuation "
                                 f"({count} prefixes, numbered from 0)")
            taps = f.get_tensor(f"taps.{i}") if f"taps.{i}" in names else None
            rounds.append(Round(taps, f.get_tensor(f"prefix.{i}"), f.get_tensor(f"continuation.{i}")))
    if not rounds:
        raise ValueError(f"{path}: no gate rounds (prefix.0, continuation.0, taps.0, ...)")
    return rounds, meta


# -- measuring -----------------------------------------------------------------------------

def history_of(drafter, r: Round):
    """The history a worker would hold at this round. Only the n rows stored are given:
    History keeps at most `window` rows and DeviceWindows (window.py) encodes only the last
    min(rows, window) of them, at positions counted back from the history's length, so the
    rows before t - n (which benchmarks/dsv4_exl3_check.py fills with zeros) are never read.
    The file's n must therefore cover min(t, the drafter's window), checked here."""
    h = drafter.new_history()
    t = len(r.prefix) - 1
    rows = None
    if drafter.feature:
        if r.taps is None or r.taps.ndim != 2 or r.taps.shape[1] != drafter.feature:
            raise ValueError(f"round at position {t}: taps {None if r.taps is None else r.taps.shape}, "
                             f"the drafter reads rows of width {drafter.feature}")
        if len(r.taps) < min(t, drafter.window):
            raise ValueError(f"round at position {t}: {len(r.taps)} tap rows, the drafter's window "
                             f"reads {min(t, drafter.window)}")
        rows = np.asarray(r.taps[len(r.taps) - min(t, len(r.taps)):], np.float32)
    h.reset(np.asarray(r.prefix, np.int32), rows)
    return h


def accepted(drafts: np.ndarray, continuation: np.ndarray) -> int:
    """Greedy verification: the longest prefix of the drafts equal to the target's tokens."""
    n = min(len(drafts), len(continuation))
    differ = np.flatnonzero(np.asarray(drafts[:n]) != np.asarray(continuation[:n]))
    return int(differ[0]) if len(differ) else n


def measure(reference, candidate, rounds: list[Round], depth: int | None = None,
            goal: float = GOAL, progress: Callable[[], None] | None = None) -> dict:
    """Both drafters on every round: greedy drafts (T = 0) of `depth` tokens (default: the
    shortest continuation, capped by both drafters' max_depth), and the first draft's
    distribution at T = 1; progress() after each round. acceptance_ratio = the candidate's mean accepted length over the
    reference's; where the reference accepts nothing the rounds measure nothing, so the ratio
    is None and the gate does not pass (0/0 is no evidence of fidelity)."""
    if reference.feature != candidate.feature or reference.vocab_size != candidate.vocab_size:
        raise ValueError(f"the reference (feature {reference.feature}, vocab {reference.vocab_size}) "
                         f"and the candidate (feature {candidate.feature}, vocab "
                         f"{candidate.vocab_size}) are not the same drafter")
    most = min(reference.max_depth, candidate.max_depth, *(len(r.continuation) for r in rounds))
    depth = most if depth is None else depth
    if not 1 <= depth <= most:
        raise ValueError(f"depth {depth}: between 1 and {most} (the drafters' max_depth and the "
                         "shortest continuation)")
    lengths = {"reference": [], "candidate": []}
    same = np.zeros(depth)  # rounds whose first j + 1 drafts are identical
    tv = []
    for r in rounds:
        chains, first = {}, {}
        for name, d in (("reference", reference), ("candidate", candidate)):
            h = history_of(d, r)
            chains[name] = d.draft([DraftRequest(h, depth)], want_probs=False)[0].tokens
            lengths[name].append(accepted(chains[name], r.continuation[:depth]))
            probs = d.draft([DraftRequest(h, 1, temperature=1.0)], want_probs=True)[0].probs
            first[name] = probs[0].astype(np.float64) if probs is not None and len(probs) else None
        a, b = chains["reference"], chains["candidate"]
        same[:accepted(a, b)] += 1  # a chain cut short (a confidence cut-off) agrees no further
        if first["reference"] is not None and first["candidate"] is not None:
            tv.append(0.5 * float(np.abs(first["reference"] - first["candidate"]).sum()))
        if progress is not None:
            progress()
    ref, cand = float(np.mean(lengths["reference"])), float(np.mean(lengths["candidate"]))
    ratio = cand / ref if ref > 0 else None
    return {"rounds": len(rounds), "depth": depth, "reference_accepted": ref,
            "candidate_accepted": cand, "acceptance_ratio": ratio,
            "agreement": (same / len(rounds)).tolist(),
            "tv": float(np.mean(tv)) if tv else None, "tv_max": float(np.max(tv)) if tv else None,
            "goal": goal, "passed": ratio is not None and ratio >= goal and len(rounds) >= MIN_ROUNDS}


# -- the record ----------------------------------------------------------------------------

def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("dsv41-remote-drafter")
    except PackageNotFoundError:
        return "unknown"


def pack_formats(pack: str) -> dict[str, str]:
    """How each module of a pack is stored, from its safetensors headers (no tensor read):
    "exl3 K bits" for a module with a trellis ([in/16, out/16, 16 K]), else its weight's dtype
    ("dense BF16"). The gate records it, so a pack re-quantised since (its head at other bits,
    an expert left dense) is refused by module name before anything is loaded."""
    from safetensors import safe_open
    trellis, dense = {}, {}
    for name in sorted(os.listdir(pack)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(pack, name), framework="np") as f:
                for key in f.keys():
                    if key.endswith(".trellis"):
                        trellis[key.removesuffix(".trellis")] = f"exl3 {f.get_slice(key).get_shape()[-1] // 16} bits"
                    elif key.endswith(".weight"):
                        dense[key.removesuffix(".weight")] = f"dense {f.get_slice(key).get_dtype()}"
    return {**dense, **trellis}  # a module stored both ways is served from its trellis


def changed_modules(recorded: dict[str, str], now: dict[str, str], most: int = 4) -> str | None:
    """One line naming the modules stored otherwise than the gate measured them, or None."""
    changed = sorted(m for m in recorded.keys() | now.keys() if recorded.get(m) != now.get(m))
    if not changed:
        return None
    named = "; ".join(f"{m}: {now.get(m, 'absent')}, gated as {recorded.get(m, 'absent')}" for m in changed[:most])
    return named + (f" (and {len(changed) - most} more)" if len(changed) > most else "")


def record(pack: str, result: dict, drafter_digest: str, reference_digest: str,
           rounds_path: str, target_digest: str | None = None) -> str:
    """Write GATE_FILE into `pack`: the result, what it was measured on, and how the pack's
    modules were stored when it was (pack_formats)."""
    rec = {"format": FORMAT, **result, "drafter": drafter_digest, "modules": pack_formats(pack),
           "reference_drafter": reference_digest, "rounds_sha256": sha256_file(rounds_path),
           "target": target_digest, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "version": package_version()}
    path = os.path.join(pack, GATE_FILE)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    return path


def weights_of(manifest) -> str:
    """What a record names the measured weights by: the drafter digest and the Markov head's
    (the drafter digest leaves the Markov head out: identity.Manifest)."""
    return f"{manifest.drafter}/{manifest.markov}"


def read_record(pack: str) -> dict | None:
    path = os.path.join(pack, GATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def summary(rec: dict) -> str:
    ratio = rec.get("acceptance_ratio")
    share = "n/a (the reference accepted nothing)" if ratio is None else f"{ratio:.1%}"
    return (f"accepted length {rec['candidate_accepted']:.3f} vs the reference's "
            f"{rec['reference_accepted']:.3f}: {share} of it, goal {rec['goal']:.0%} "
            f"({rec['rounds']} rounds, depth {rec['depth']}, {rec.get('date', '?')})")
