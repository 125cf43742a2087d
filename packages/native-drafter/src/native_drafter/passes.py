"""Recorded gate passes: which kernels passed the gate on which GPU. The worker serves
`--kernels native` only when a pass is recorded for this GPU (name and UUID) and these
kernels (the digest of their source and of the compiler that builds them); any change to
either needs a fresh `native-drafter gate`. Records live in NATIVE_DRAFTER_STATE."""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch
import triton

from . import env

SOURCES = ("kernels.py", "native.py")
FILE = "gate-passes.json"


class NotGated(ValueError):
    """No recorded gate pass for these kernels on this device."""


def kernel_digest() -> str:
    """sha256 of the kernel sources and the Triton version that compiles them."""
    h = hashlib.sha256(f"triton {triton.__version__}\0".encode())
    here = os.path.dirname(__file__)
    for name in SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def device_identity(device) -> dict:
    """The GPU's name and UUID; on the CPU, the Triton interpreter (tests only)."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "uuid": str(getattr(props, "uuid", "unknown"))}
    if os.environ.get("TRITON_INTERPRET") == "1":
        return {"name": "cpu (TRITON_INTERPRET=1)", "uuid": "cpu"}
    raise NotGated(f"native kernels run on CUDA devices (or the CPU under TRITON_INTERPRET=1), not {device}")


def _key(device) -> str:
    return f"{device_identity(device)['uuid']}:{kernel_digest()}"


def _path(state_dir: str | None) -> str:
    return os.path.join(os.path.expanduser(state_dir or env.NATIVE_DRAFTER_STATE.get()), FILE)


def _read(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def record(device, summary: dict, state_dir: str | None = None) -> str:
    """Record a pass (call only for a passed gate); returns the file written."""
    path = _path(state_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    passes = _read(path)
    passes[_key(device)] = {**device_identity(device), "kernels": kernel_digest(),
                            "triton": triton.__version__, "torch": torch.__version__,
                            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **summary}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(passes, f, indent=1)
    os.replace(tmp, path)
    return path


def require(device, state_dir: str | None = None) -> dict:
    """The recorded pass for this device and these kernels, or NotGated saying what to run."""
    path = _path(state_dir)
    found = _read(path).get(_key(device))
    if found is None:
        ident = device_identity(device)
        raise NotGated(f"the native kernels (digest {kernel_digest()[:12]}, triton {triton.__version__}) "
                       f"have no recorded gate pass on {ident['name']} ({ident['uuid']}) in {path}: "
                       "run `native-drafter gate` on this machine first, or serve with --kernels torch")
    return found
