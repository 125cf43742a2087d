"""The drafter inside vLLM (the only room here that imports vLLM): `proposer` (RemoteProposer,
vLLM's `custom_class` proposer), `hooks` (register(), the `vllm.general_plugins` entry point
that patches the model runner), `versions` (the vLLM code the hooks rely on, by digest),
`tensor_parallel` (one round per TP group), `client_factory` (the client from the env)."""

from .hooks import register
from .proposer import RemoteProposer

__all__ = ["RemoteProposer", "register"]
