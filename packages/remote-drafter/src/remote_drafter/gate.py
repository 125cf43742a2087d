"""The fidelity gate of an EXL3 drafter (issue 19: "a drafter that fails the fidelity gate is
not served"). The quantised drafter (the candidate) and its dense original (the reference)
draft from the same recorded rounds of the target; the candidate passes when its mean
accepted length under greedy verification is at least GOAL of the reference's. The result is
recorded in the pack folder (GATE_FILE) and the worker serves a pack only while that record
passed for exactly the drafter it loaded (`refusal`).

Torch-free at import (torch and safetensors are imported where used): reading a record, as
the worker's early check and a launcher do, needs neither.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from .drafters import DraftRequest
from .identity import sha256_file
from .sampling import is_greedy

log = logging.getLogger(__name__)
GATE_FILE = "exl3-gate.json"  # not exl3.json: packs from exllamav3's own converter have none
GOAL = 0.97                   # the issue's bar: >= 97% of bf16's acceptance at 4 bits
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


# -- recording rounds from the engine's own traffic ----------------------------------------

class RoundRecorder:
    """Gate rounds from the requests a worker serves (`worker --record-gate-rounds FILE`).
    At T = 0 speculative decoding commits exactly the target's greedy tokens, and the rows
    the engine sends are the target's taps: a request's history is a recording of the target.
    A round starts at a commit (its anchor: the newest token, at position t; the window's rows
    before it), at most one per request at a time and `spacing` positions apart; it completes
    once `depth` more tokens are committed (its continuation). With `count` rounds in, the
    file is written (beside the serving, in a thread) and recording stops; `close()` writes
    what there is. Requests at other temperatures are not recorded."""

    def __init__(self, path: str, count: int, depth: int, target_digest: str | None,
                 spacing: int = 256, hidden_layers=()):
        why = recording_refusal(path, count)
        if why:
            raise ValueError(why)
        self.path, self.count, self.depth, self.spacing = path, count, depth, spacing
        self.target_digest, self.hidden_layers = target_digest, list(hidden_layers)
        self.done: list[Round] = []
        self.pending: dict = {}   # request key -> (t, taps, prefix)
        self.last_start: dict = {}  # request key -> the anchor of its last round
        self.writer = None
        self.written = 0          # rounds in the file, once written
        self.error: str | None = None  # why writing it failed

    @property
    def full(self) -> bool:
        return len(self.done) >= self.count

    def seen(self, key, history, temperature: float) -> None:
        """After a request's open or commit (its history as it now stands)."""
        if self.full or not is_greedy(temperature):
            return
        kept = history.length - len(history.tokens)  # positions before the kept tokens
        if key in self.pending:
            t, taps, prefix = self.pending[key]
            if history.length < t + 1 + self.depth:
                return
            del self.pending[key]
            start = t + 1 - kept
            if start >= 0:  # else the continuation already left the kept tokens
                self.done.append(Round(taps, prefix, history.tokens[start:start + self.depth].astype(np.int64)))
                if self.full:
                    self._write()
            return
        t = history.length - 1
        if t - self.last_start.get(key, -self.spacing) < self.spacing or t < 1:
            return
        rows = history.rows
        if rows is not None and len(rows) < min(t, history.window):
            return  # opened with fewer rows than its window reads: the gate could not use it
        self.last_start[key] = t
        taps = None if rows is None else np.array(rows, np.float16)
        # tokens before the kept ones are zeros: the gated drafters read the anchor, the
        # length and the window's rows, not earlier tokens
        prefix = np.concatenate([np.zeros(kept, np.int64), history.tokens.astype(np.int64)])
        self.pending[key] = (t, taps, prefix)

    def forget(self, key) -> None:
        self.pending.pop(key, None)
        self.last_start.pop(key, None)

    def close(self) -> None:
        if self.writer is None and self.done:
            self._write()
        if self.writer is not None:
            self.writer.join()

    def _write(self) -> None:
        rounds = list(self.done)
        self.writer = threading.Thread(target=self._save, args=(rounds,), name="gate-rounds",
                                       daemon=False)
        self.writer.start()

    def _save(self, rounds: list[Round]) -> None:
        try:
            write_rounds(self.path, rounds, self.target_digest, hidden_layers=self.hidden_layers)
        except Exception as exc:  # noqa: BLE001 - the worker serves on; status says why
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("writing %d gate rounds to %s failed: %s", len(rounds), self.path, self.error)
            return
        self.written = len(rounds)
        log.info("wrote %d gate rounds to %s", len(rounds), self.path)


def recording_refusal(path: str, count: int) -> str | None:
    """Why rounds cannot be recorded into `path` (checked at start-up, not after hours)."""
    if count < 1:
        return f"--gate-rounds {count}: record at least 1 (the gate needs {MIN_ROUNDS})"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"--record-gate-rounds {path}: {folder} is not a folder this process can write"
    return None


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
            goal: float = GOAL) -> dict:
    """Both drafters on every round: greedy drafts (T = 0) of `depth` tokens (default: the
    shortest continuation, capped by both drafters' max_depth), and the first draft's
    distribution at T = 1. acceptance_ratio = the candidate's mean accepted length over the
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


def record(pack: str, result: dict, drafter_digest: str, reference_digest: str,
           rounds_path: str, target_digest: str | None = None) -> str:
    """Write GATE_FILE into `pack`: the result and what it was measured on."""
    rec = {"format": FORMAT, **result, "drafter": drafter_digest,
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
    if rec.get("drafter") == rec.get("reference_drafter"):
        return f"{pack} was gated against its own weights: gate it against its dense drafter"
    if drafter_digest is not None and rec.get("drafter") != drafter_digest:
        return (f"{pack}'s fidelity gate record is for drafter {str(rec.get('drafter'))[:12]}, "
                f"the pack loads as {drafter_digest[:12]}: its weights changed since; run the gate again")
    if target_digest and rec.get("target") and rec["target"] != target_digest:
        return (f"{pack}'s fidelity gate ran on target {rec['target'][:12]}'s rounds, this worker "
                f"serves target {target_digest[:12]}: run the gate with rounds of this target")
    return None
