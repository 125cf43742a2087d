"""Shared pieces of the native kernels' tests: a tiny DSpark drafter (head dim 32, so the
kernels' tile shapes are the GPU's too) and its checkpoint, and the Triton interpreter on
machines without a GPU. Imported before anything imports native_drafter.kernels: Triton
picks interpreter or compiler when a kernel is defined."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the native kernels' tests need Triton (native-drafter[test])")

from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter, DSparkModel, init_weights
from remote_drafter.models.llama import LlamaConfig, random_llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGET = LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256)


def tiny_config(width: int = 5, **over) -> DSparkConfig:
    return DSparkConfig(**{**dict(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=256, block_size=width, markov_rank=8, window=16,
                                  target_layers=[0, 3], target_hidden_size=128, mask_token_id=511), **over})


def tiny_model(seed: int = 0, width: int = 5, **over) -> DSparkModel:
    g = torch.Generator().manual_seed(seed)
    c = tiny_config(width, **over)
    model = DSparkModel(c, torch.randn(c.vocab_size, c.hidden_size, generator=g),
                        torch.randn(c.vocab_size, c.hidden_size, generator=g) * 0.3)
    return init_weights(model, seed, std=0.08).eval()


def tiny_checkpoint(folder) -> tuple[str, str]:
    """(checkpoint, target) folders: a random tiny target and a DSpark drafter built for it."""
    target, ckpt = str(folder / "target"), str(folder / "drafter")
    random_llama(TARGET, seed=3).save(target)
    DSparkDrafter.create(ckpt, target, tiny_config(), seed=4, init_std=0.08)
    return ckpt, target
