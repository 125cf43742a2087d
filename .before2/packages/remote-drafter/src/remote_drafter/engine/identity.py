"""Identities: content digests of the target weights, the tokenizer, the drafter and its
Markov head, gathered in a manifest. Worker and client compare manifests in the ofl
handshake (check_worker, which the engine's link and the proxy's adapter both use), and
every request carries the manifest's fingerprint. Torch-free."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

from . import protocol

NONE = "none"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_file_digests: dict[tuple, str] = {}


def digest_files(paths: Iterable[str]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(os.path.basename(path).encode() + b"\0")
        _hash_file(h, path)
    return h.hexdigest()


def sha256_file(path: str) -> str:
    """One file's sha256 (records naming exactly the bytes they were made from)."""
    return _hash_file(hashlib.sha256(), path).hexdigest()


def _hash_file(h, path: str):
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h


def target_digest(folder: str) -> str:
    """sha256 over the target's safetensors files (names and bytes), cached per process."""
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (not a target checkpoint)")
    key = tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files)
    if key not in _file_digests:
        _file_digests[key] = digest_files(files)
    return _file_digests[key]


def tokenizer_digest(folder: str) -> str:
    files = [os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.exists(os.path.join(folder, n))]
    return digest_files(files) if files else NONE


def digest_tensors(items: Iterable[tuple[str, bytes]]) -> str:
    """sha256 over (name, bytes) pairs in the given order (a checkpoint's own tensors)."""
    h = hashlib.sha256()
    for name, data in items:
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    target: str = NONE      # the target weights the drafter was built for
    tokenizer: str = NONE
    drafter: str = NONE     # drafter weights and config (without the Markov head)
    markov: str = NONE      # the Markov head's weights
    kind: str = NONE        # which drafter back end (dspark, ngram, lm, ...)

    @property
    def fingerprint(self) -> bytes:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()[:16]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown manifest fields {sorted(unknown)}")
        return cls(**{k: str(v) for k, v in data.items()})

    @classmethod
    def load(cls, path: str) -> Manifest:
        with open(path) as f:
            return cls.from_json(json.load(f))

    def mismatches(self, other: Manifest, fields_to_check: Iterable[str] | None = None) -> list[str]:
        """Fields where `other` differs; an expectation of NONE checks nothing."""
        out = []
        for name in fields_to_check or [f.name for f in fields(self)]:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != NONE and mine != theirs:
                out.append(f"{name}: expected {mine[:16]}, worker has {theirs[:16]}")
        return out


def expectation(target_folder: str | None, manifest_path: str | None) -> Manifest:
    """What an engine expects of its worker: its target's and tokenizer's digests, plus the
    drafter and Markov digests of an operator's manifest when one is given."""
    base = Manifest.load(manifest_path) if manifest_path else Manifest()
    if not target_folder:
        return base
    mine = Manifest(target_digest(target_folder), tokenizer_digest(target_folder))
    if base.target not in (NONE, mine.target) or base.tokenizer not in (NONE, mine.tokenizer):
        raise ValueError(f"manifest {manifest_path} names another target or tokenizer than "
                         f"{target_folder}")
    return Manifest(mine.target, mine.tokenizer, base.drafter, base.markov, base.kind)


def check_worker(expect: Manifest):
    """A verify_peer hook: refuse a worker built for another target, tokenizer or drafter."""
    def verify(metadata: dict) -> None:
        described = metadata.get("remote_drafter")
        if not isinstance(described, dict):
            raise ValueError("the peer is not a remote-drafter worker")
        if described.get("protocol") != protocol.VERSION:
            raise ValueError(f"worker speaks drafter protocol {described.get('protocol')}, "
                             f"this client {protocol.VERSION}")
        wrong = expect.mismatches(Manifest.from_json(described["manifest"]))
        if wrong:
            raise ValueError("identity mismatch: " + "; ".join(wrong))
    return verify
