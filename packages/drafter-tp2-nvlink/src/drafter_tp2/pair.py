"""Pair safety: what each rank reports about itself at start-up, and the checks both ranks
run on both reports before anything is served (both reach the same verdict, so both
refuse together, with the same reason)."""

from __future__ import annotations

import shutil
import socket
import subprocess

import torch

from remote_drafter.worker.device_lock import device_key


def torch_device(device: str) -> str:
    """What tensors go to: 'cpu:1' is the key of a second CPU 'device', tensors live on cpu."""
    return "cpu" if torch.device(device).type == "cpu" else device


def _nvlink_links(index: int) -> int | None:
    """Active NVLink links of GPU `index` as the driver reports them (nvidia-smi), or None
    when it cannot say."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "nvlink", "--status", "-i", str(index)],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.splitlines() if "GB/s" in line and "inactive" not in line.lower())


def peer_link(mine: str, other: str) -> dict:
    """P2P and NVLink between this rank's device and the other's, from torch and the driver."""
    a, b = torch.device(mine), torch.device(other)
    if a.type != "cuda":
        return {"p2p": None, "nvlink_links": None, "text": "cpu, no peer link"}
    if b.type != "cuda" or b.index is None or b.index >= torch.cuda.device_count():
        return {"p2p": False, "nvlink_links": None, "text": f"{other} is not visible here"}
    p2p = torch.cuda.can_device_access_peer(a.index, b.index)
    links = _nvlink_links(a.index)
    return {"p2p": p2p, "nvlink_links": links,
            "text": f"P2P {'yes' if p2p else 'no'}, NVLink "
                    f"{'unknown' if links is None else f'{links} active links'}"}


def describe_rank(rank: int, devices: list[str], fingerprint: str, source: str,
                  config: dict, tensors: dict | None = None, cannot: str | None = None) -> dict:
    """tensors: {name: digest} of what this rank read, where the ranks read different
    parts of one checkpoint (the others compare what both read); cannot: why this rank
    could not load its part."""
    mine, other = devices[rank], devices[1 - rank]
    info = {"rank": rank, "device": mine, "key": device_key(mine), "host": socket.gethostname(),
            "fingerprint": fingerprint, "source": source, "config": config,
            "peer": peer_link(mine, other), "torch": torch.__version__,
            "tensors": tensors, "cannot": cannot}
    if torch.device(mine).type == "cuda":
        info["name"] = torch.cuda.get_device_name(torch.device(mine))
    return info


def refusals(infos: list[dict], require_p2p: bool) -> list[str]:
    """Why this pair must not serve (empty: it may)."""
    a, b = infos
    cannot = [f"rank {i['rank']} cannot load its part of {i['source']}: {i['cannot']}"
              for i in infos if i.get("cannot")]
    if cannot:  # nothing else to compare
        return cannot
    why = []
    if a["key"] == b["key"]:
        why.append(f"the same device twice: both ranks are on {a['key']} ({a['device']}, {b['device']})")
    if a.get("tensors") is not None and b.get("tensors") is not None:
        differ = sorted(n for n in a["tensors"].keys() & b["tensors"].keys()
                        if a["tensors"][n] != b["tensors"][n])
        if differ:
            more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
            why.append(f"different weights: rank 0 ({a['source']}) and rank 1 ({b['source']}) hold "
                       f"different {', '.join(differ[:8])}{more}")
    elif a["fingerprint"] != b["fingerprint"]:
        why.append(f"different weights: rank 0 loaded {a['fingerprint'][:16]} from {a['source']}, "
                   f"rank 1 {b['fingerprint'][:16]} from {b['source']}")
    differ = sorted(k for k in a["config"].keys() | b["config"].keys()
                    if a["config"].get(k) != b["config"].get(k))
    if differ:
        why.append("different configuration: " + ", ".join(
            f"{k} {a['config'].get(k)!r} vs {b['config'].get(k)!r}" for k in differ))
    if a["torch"] != b["torch"]:
        why.append(f"different torch builds: {a['torch']} vs {b['torch']}")
    for info in infos:
        if require_p2p and info["peer"]["p2p"] is False:
            why.append(f"rank {info['rank']} ({info['device']}) has no P2P access to its peer: "
                       f"{info['peer']['text']} (DRAFTER_TP2_REQUIRE_P2P=0 serves anyway)")
    return why
