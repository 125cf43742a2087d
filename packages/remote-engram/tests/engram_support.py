"""Only a re-export for test_engram_vllm.py until it imports remote_engram.testing itself;
then this file goes."""

from remote_engram.testing import EngramServeProcess  # noqa: F401
