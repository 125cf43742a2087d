"""The corpus builder on a small sample: a real .deb made here with dpkg-deb and a source
tarball, through the same unpack / select / deduplicate / split / manifest path as the
real packages, then tokenized with a tokenizer.json."""

import gzip
import io
import json
import shutil
import subprocess
import tarfile

import numpy as np
import pytest

from native_drafter import corpus
from native_drafter.corpus import Rule, Source

PROSE = "The drafter proposes tokens; the target verifies them in one pass.\n\n" * 8
CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 6
YAML = "properties:\n  compatible:\n    const: vendor,device\n  reg:\n    maxItems: 1\n" * 6


def make_deb(root, out):
    doc = root / "usr/share/doc/pkg"
    (doc / "sub").mkdir(parents=True)
    (doc / "translations").mkdir()
    with gzip.open(doc / "guide.rst.gz", "wt") as f:
        f.write(PROSE)
    (doc / "sub" / "copy.rst").write_text(PROSE.replace("\n", "  \n"))  # a duplicate, up to blanks
    (doc / "binding.yaml").write_text(YAML)
    (doc / "short.rst").write_text("too short")
    (doc / "blob.rst").write_bytes(b"\x00\x01binary" * 50)
    (doc / "translations" / "other.rst").write_text(PROSE + "x")
    (root / "usr/lib/tool").mkdir(parents=True)
    (root / "usr/lib/tool/mod.py").write_text(CODE)
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text("Package: sample\nVersion: 1.0\nArchitecture: all\n"
                                         "Maintainer: t <t@example.org>\nDescription: sample\n")
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(out)], check=True,
                   capture_output=True)


def make_sdist(path):
    text = "\n\n".join(f"Act {i}. Enter the players, and speak the speech trippingly." * 3 for i in range(40))
    with tarfile.open(path, "w:gz") as tar:
        data = text.encode()
        info = tarfile.TarInfo("plays-0.1/data/hamlet_gut.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not shutil.which("dpkg-deb"):
        pytest.skip("dpkg-deb is not installed (Debian's dpkg)")
    tmp = tmp_path_factory.mktemp("corpus")
    make_deb(tmp / "root", tmp / "sample.deb")
    make_sdist(tmp / "plays-0.1.tar.gz")
    sources = (
        Source("sample", "test licence",
               (Rule("*/usr/share/doc/pkg/*.yaml", "structured"), Rule("*/usr/share/doc/pkg/*.rst", "prose"),
                Rule("*/usr/lib/tool/*.py", "code")), exclude=("*/translations/*",)),
        Source("pypi:plays==0.1", "public domain", (Rule("*_gut.txt", "prose"),), chunk_chars=600),
    )
    manifest = corpus.build(str(tmp / "out"), str(tmp / "cache"), sources,
                            archives={"sample": str(tmp / "sample.deb"), "pypi:plays==0.1": str(tmp / "plays-0.1.tar.gz")})
    return tmp / "out", manifest


def test_selects_deduplicates_and_classifies(built):
    out, manifest = built
    docs = corpus.read_split(str(out), "train") + corpus.read_split(str(out), "validation")
    paths = sorted(d["path"] for d in docs if d["source"] == "sample")
    # the gzipped guide, the YAML and the module; not its blank-only copy, the short file,
    # the binary one or the translation
    assert paths == ["/usr/lib/tool/mod.py", "/usr/share/doc/pkg/binding.yaml", "/usr/share/doc/pkg/guide.rst.gz"]
    assert {d["path"]: d["klass"] for d in docs if d["source"] == "sample"} == {
        "/usr/lib/tool/mod.py": "code", "/usr/share/doc/pkg/binding.yaml": "structured",
        "/usr/share/doc/pkg/guide.rst.gz": "prose"}
    sample = next(s for s in manifest["sources"] if s["name"] == "sample")
    assert sample["duplicates_dropped"] == 1 and sample["documents"] == 3
    plays = [d for d in docs if d["source"] == "pypi:plays==0.1"]
    assert len(plays) > 3 and all(d["path"].startswith("/plays-0.1/data/hamlet_gut.txt#") for d in plays)
    assert len({d["digest"] for d in docs}) == len(docs)


def test_split_is_by_document_and_stable(built):
    out, manifest = built
    for split in ("train", "validation"):
        for d in corpus.read_split(str(out), split):
            assert corpus.Document(d["source"], d["path"], d["klass"], d["text"]).split == split
    assert manifest["files"]["train"]["sha256"] == corpus.sha256_file(str(out / "train.jsonl"))
    assert manifest["digest"] == corpus.corpus_digest(manifest["files"])
    total = sum(sum(v.values()) for v in manifest["documents"].values())
    assert total == len(corpus.read_split(str(out), "train")) + len(corpus.read_split(str(out), "validation"))


def test_tokenize_round_trips(built, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    out, _ = built
    docs = corpus.read_split(str(out), "train")
    words = sorted({w for d in docs for w in d["text"].split()})
    tok = Tokenizer(models.WordLevel({w: i + 1 for i, w in enumerate(words)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    info = corpus.tokenize(str(out), str(tmp_path / "tokenizer.json"), str(tmp_path / "tokens"))
    tokens, offsets, classes = corpus.load_tokens(str(tmp_path / "tokens"), "train")
    assert tokens.dtype == np.uint16 and len(offsets) == len(docs) + 1 and len(classes) == len(docs)
    first = docs[0]["text"].split()
    assert [words[i - 1] for i in tokens[offsets[0]:offsets[1]]] == first
    assert info["splits"]["train"]["tokens"] == int(offsets[-1])
    assert json.loads((tmp_path / "tokens" / "tokens.json").read_text())["corpus_digest"] == \
        json.loads((out / "manifest.json").read_text())["digest"]
