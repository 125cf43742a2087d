"""Test helpers the drafter suites share (remote-drafter's, drafter-tp2's, native-drafter's, the
stack's): tiny targets and drafters on disk, a real worker process, a client on another
loopback address (another host, to the worker), a drafter that is wrong on purpose, and Triton
kernels compiled for a GPU on a machine without one. Torch side: it needs the [worker] extra,
as the drafters it builds do (and Triton for the compiling)."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import numpy as np

from ofl import Connection
from ofl.testing import ChildProcess
from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter
from remote_drafter.models.llama import LlamaConfig, random_llama
from remote_drafter.models.lm import LMDrafter
from remote_drafter.worker.server import spawn_worker

TINY = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128)
HIDDEN_LAYERS = (0, 2, 3)


def make_models(base: str) -> dict:
    """target/ (random tiny Llama), dspark/ (hidden-state drafter), dspark-tokens/ (token-only)."""
    paths = {name: os.path.join(base, name) for name in ("target", "dspark", "dspark-tokens")}
    random_llama(TINY, seed=0).save(paths["target"])
    common = dict(vocab_size=TINY.vocab_size, hidden_size=TINY.hidden_size, num_heads=4,
                  num_kv_heads=2, window=16, mask_token_id=TINY.vocab_size - 1)
    DSparkDrafter.create(paths["dspark"], paths["target"],
                         DSparkConfig(**common, target_layers=list(HIDDEN_LAYERS),
                                      target_hidden_size=TINY.hidden_size), init_std=0.3)
    DSparkDrafter.create(paths["dspark-tokens"], paths["target"], DSparkConfig(**common), seed=1,
                         init_std=0.3)
    return paths


class WrongEveryThird(LMDrafter):
    """The target's copy, but every draft at a position divisible by 3 is off by one:
    exercises rejection and rollback at known places (deterministic, so exact). It knows
    its planted error: the true token is its likeliest alternative there (what the
    speculation cache plans a correction from). A worker serves it as
    'remote_drafter.testing:WrongEveryThird'."""

    kind = "lm-wrong-every-third"

    def __init__(self, target, device="cpu", **options):
        base = LMDrafter.from_folder(target, device=device, **options)
        super().__init__(base.model, base.manifest(), device, base.max_depth, base.history_tokens)

    def draft(self, requests, want_probs):
        out = super().draft(requests, want_probs)
        for r, d in zip(requests, out):
            for i in range(len(d.tokens)):
                if (r.history.length + i) % 3 == 0:
                    d.alt_tokens[i], d.alt_probs[i] = d.tokens[i], d.own_probs[i]
                    d.tokens[i], d.own_probs[i] = (d.tokens[i] + 1) % self.vocab_size, 0.0
                    if d.probs is not None:
                        d.probs[i] = np.eye(self.vocab_size, dtype=np.float32)[d.tokens[i]]
        return out


class WorkerProcess(ChildProcess):
    """A real `remote-drafter worker` process on 127.0.0.1."""

    def __init__(self, drafter: str, target: str | None, backend: str = "tcp", port: int = 0,
                 *extra, env: dict | None = None):
        """`env` adds variables to the worker's environment; target None: no --target."""
        self.args, self.env = [drafter, target, backend, *extra], env
        self.proc, self.address = spawn_worker(
            ["--drafter", drafter, *(["--target", target] if target else []), "--backend", backend,
             "--listen", f"127.0.0.1:{port}", *extra], stderr=subprocess.DEVNULL,
            env={**os.environ, **env} if env else None)

    def restart(self) -> None:
        """Kill -9 and start again on the same port (state lost)."""
        self.kill()
        drafter, target, backend, *extra = self.args
        deadline = time.monotonic() + 10
        while True:
            try:
                fresh = WorkerProcess(drafter, target, backend, int(self.address.rsplit(":", 1)[1]),
                                      *extra, env=self.env)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.proc, self.address = fresh.proc, fresh.address


class ConnectionFrom(Connection):
    """An ofl connection from `source`, an address of 127.0.0.0/8 other than the worker's:
    the worker sees another peer, as it would another host (ofl's Connection picks no
    source address itself)."""

    def __init__(self, source: str, address: str, **options):
        self.source = source
        super().__init__(address, **options)

    def _open_socket(self, deadline: float) -> socket.socket:
        return socket.create_connection(self.address, max(deadline - time.monotonic(), 0.001),
                                        source_address=(self.source, 0))


def draft_agreement(a: list, b: list) -> dict:
    """Identical greedy drafts of two drafters on the same requests; where they part, the
    first drafter's gap there between its token's probability and the runner-up's (a near-tie
    is a small gap)."""
    gaps = []
    for x, y in zip(a, b):
        n = min(len(x.tokens), len(y.tokens))
        differ = [*np.flatnonzero(x.tokens[:n] != y.tokens[:n]), *([n] if len(x.tokens) != len(y.tokens) else [])]
        if differ:
            i = min(differ[0], len(x.tokens) - 1)
            gaps.append(round(float(x.own_probs[i] - x.alt_probs[i]), 6))
    return {"same_greedy_drafts": len(a) - len(gaps), "requests": len(a), "top_two_gaps_where_they_part": gaps}


def compiled_for(fn, signature: dict, constexprs: dict, arch: int, **options):
    """Triton kernel `fn` compiled for CUDA sm_`arch` by Triton's own compiler and ptxas, no
    GPU needed: its parameters' types in `signature`, its constexprs by value; `options`: the
    launch's (num_warps, num_stages). Run it where TRITON_INTERPRET is unset: Triton decides
    between its interpreter and its compiler when a kernel is defined."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    if set(sig) != set(fn.arg_names):
        raise ValueError(f"name every parameter of {fn.__name__}")
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def cubin_dump(kernel, what: str = "--dump-resource-usage") -> str:
    """A compiled kernel's cubin as the cuobjdump Triton ships prints it (`what`: its resource
    usage, or -sass for the instructions)."""
    import tempfile

    import triton.backends.nvidia as nvidia
    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, what, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(kernel) -> str:
    """A compiled kernel's resource line: registers, spilled bytes (STACK), local memory..."""
    return " ".join(line.strip() for line in cubin_dump(kernel).splitlines() if "REG:" in line)


def compile_report(script: str, arch: int, cache_dir: str) -> dict:
    """What `script --arch ARCH` prints last, as JSON: a compile script (tests' gpu_kernels.py,
    native_gpu_compile.py) run in a process of its own, TRITON_INTERPRET unset there so its
    kernels are compiled, Triton's cache in `cache_dir` (CI caches nothing outside the repo)."""
    import json
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton >= 3.9 warns when unset; 3.6 fuses by default
    run = subprocess.run([sys.executable, str(script), "--arch", str(arch)], env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode:
        raise AssertionError(f"{script} --arch {arch} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.splitlines()[-1])


def spill_free(usage: str) -> bool:
    """A resource_usage line with nothing in local memory: no register spilled."""
    return " STACK:0 " in usage and " LOCAL:0 " in usage
