"""The compressed token map against ARCHITECTURE.md § Engram token map's rules, on tokenizers built here."""

import pytest

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is a test dependency; "
                                 "tools/setup.sh installs it")
from tokenizers import Tokenizer, decoders, models  # noqa: E402

from remote_engram.token_map import compressed_token_map  # noqa: E402


def word_level(words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    return tok


def test_normalisation_merges_case_accents_width_and_spaces():
    words = ["<unk>", "Hello", "hello", "HELLO", "café", "cafe", " ", "  ", "\t\n", "Ｈｅｌｌｏ",
             "x y", "x  \t y", " pad ", "ﬁ", "fi"]
    mapping, size = compressed_token_map(word_level(words))
    ids = dict(zip(words, mapping.tolist()))
    assert ids["Hello"] == ids["hello"] == ids["HELLO"] == ids["Ｈｅｌｌｏ"]  # case, NFKC width
    assert ids["café"] == ids["cafe"]                                       # accents stripped
    assert ids[" "] == ids["  "] == ids["\t\n"]                             # lone space stays " "
    assert ids["x y"] == ids["x  \t y"]                                     # runs -> one space
    assert ids["ﬁ"] == ids["fi"]                                            # NFKC ligature
    assert ids[" pad "] != ids[" "]                                         # stripped, not space
    assert mapping.tolist()[:3] == [0, 1, 1] and size == len(set(mapping.tolist()))
    # First-seen order: new ids are dense and rise with the first raw id of each key.
    firsts = {}
    for raw, new in enumerate(mapping.tolist()):
        firsts.setdefault(new, raw)
    assert sorted(firsts) == list(range(size)) and list(firsts.values()) == sorted(firsts.values())


def test_partial_utf8_keyed_by_raw_token():
    # Byte-level tokens for the two bytes of "é" decode alone to U+FFFD: each keeps its own
    # raw token string as key, so they stay distinct.
    vocab = {"a": 0, "Ã": 1, "©": 2, "Ã©": 3}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ã", "©")]))
    tok.decoder = decoders.ByteLevel()
    assert "\ufffd" in tok.decode([1]) and tok.decode([3]) == "é"
    mapping, size = compressed_token_map(tok)
    assert len({mapping[1], mapping[2], mapping[3]}) == 3 and size == 4


def test_empty_normalisation_keeps_the_text():
    # A lone combining accent normalises to "" (accents stripped): the key is the text itself.
    mapping, size = compressed_token_map(word_level(["<unk>", "\u0301", "\u0300"]))
    assert mapping[1] != mapping[2] and size == 3
