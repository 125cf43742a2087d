"""The compressed token map: raw tokenizer ids -> Engram ids (ARCHITECTURE.md
§ Engram token map).

Each token id is decoded alone. Text holding U+FFFD (a partial UTF-8 sequence) is keyed by
the raw token string; other text by its normalized form (NFKC, NFD, strip accents,
lowercase, whitespace runs to one space, strip - but a lone space stays a space), or by the
text itself when that is empty. Compressed ids are the keys in first-seen order. Uses the
tokenizers library's own normalizers, so the rules are the reference ones.
"""

from __future__ import annotations

import numpy as np

_LONE_SPACE = "\ue000"  # a private-use sentinel that protects a lone " " from Strip()


def normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
        normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE, " "),
    ])


def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """(map, Vc): map[raw id] = compressed id, for a `tokenizers.Tokenizer`."""
    norm = normalizer()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    out = np.empty(size, np.int64)
    for tid in range(size):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        out[tid] = keys.setdefault(key, len(keys))
    return out, len(keys)
