"""The proxy process: takes rounds from the host flags, performs each through the adapter
over the network with a deadline, writes the reply and raises the flag. Torch-free: it
imports only the standard library, cffi, ofl and the adapter (lazily).

  python -m async_handoff.proxy --region /dev/shm/NAME --generation G \
      --adapter async_handoff.adapters:OflMessageAdapter --adapter-config '{"address": ...}'
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback


def load_adapter(spec: str, config: dict):
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"adapter must be 'module:Class', got {spec!r}")
    return getattr(importlib.import_module(module), name)(config)


def imports() -> list[str]:
    """The packages this process loaded from outside the standard library (top-level names):
    the status shows what the proxy depends on, so engine-side code creeping in is seen."""
    return sorted({name.partition(".")[0] for name in sys.modules} - set(sys.stdlib_module_names))


def cpu_list(spec: str) -> set[int]:
    """'2,5-6' -> {2, 5, 6}."""
    cpus = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        try:
            cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"CPU list {spec!r}: expected numbers and ranges like 2,5-6") from None
    if not cpus:
        raise ValueError(f"CPU list {spec!r} names no CPU")
    return cpus


def pin(spec: str) -> list[int]:
    """Run this process on the CPUs `spec` lists; the CPUs it runs on."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, cpu_list(spec))
    except OSError as exc:
        raise ValueError(f"cannot run on CPUs {spec!r} ({exc.strerror}); this process may use "
                         f"{allowed}") from None
    return sorted(os.sched_getaffinity(0))


def self_test(flags, generation: int) -> dict:
    """Flags round trip and slot layout, before any round is taken."""
    from ._hostflags import ffi, lib

    word = ffi.new("uint32_t *")
    lib.hf_store32(word, 7)
    assert lib.hf_load32(word) == 7, "atomic store/load round trip failed"
    cell = ffi.new("uint64_t *")
    assert lib.hf_cas64(cell, 0, 5) and not lib.hf_cas64(cell, 0, 6), "compare-exchange failed"
    assert lib.hf_futex_wait(word, 8, 1000) == lib.HF_OK, "futex wait on a changed value blocked"
    info = flags.info()
    assert info.generation == generation, f"region generation {info.generation} != {generation}"
    assert flags.nslots > 0 and flags.slot_bytes > 0, "empty slot layout"
    return {"slots": flags.nslots, "slot_bytes": flags.slot_bytes}


def run(args) -> int:
    from .hostflags import PROXY_FAILED, PROXY_READY, PROXY_STARTING, WAIT_MODES, HostFlags

    flags = HostFlags.open(args.region)
    pid, parent = os.getpid(), os.getppid()
    flags.set_proxy(pid, PROXY_STARTING)
    status = {"pid": pid, "generation": args.generation, "adapter": args.adapter,
              "mode": args.mode, "mlock": flags.lock()}
    try:
        if args.cpus:  # before the adapter connects: its threads inherit the CPUs
            status["cpus"] = pin(args.cpus)
        status["layout"] = self_test(flags, args.generation)
        adapter = load_adapter(args.adapter, json.loads(args.adapter_config))
        status["peer"] = adapter.connect()
        status["imports"] = imports()
        status["torch_imported"] = "torch" in sys.modules
        if status["torch_imported"]:
            raise RuntimeError("torch was imported into the proxy process")
        status["ok"] = True
    except Exception as exc:  # noqa: BLE001 - any self-test failure is reported, then exit
        status.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        flags.write_status(status)
        flags.set_proxy(pid, PROXY_FAILED)
        traceback.print_exc()
        return 1
    flags.write_status(status)
    flags.heartbeat()
    flags.set_proxy(pid, PROXY_READY)

    from ._hostflags import lib

    mode, spin_ns = WAIT_MODES[args.mode], int(args.spin_us * 1000)
    deadline_s = args.round_deadline_ms / 1000
    beat_s = args.heartbeat_ms / 1000
    while os.getppid() == parent:  # the engine died: leave with it
        flags.heartbeat()
        rc, slot, seq, request = flags.take(args.generation, mode, spin_ns,
                                            time.monotonic() + beat_s)
        if rc == lib.HF_ETIMEDOUT:
            continue
        if rc == lib.HF_EGEN:
            return 0  # a successor owns the region now
        if rc == lib.HF_EBAD:
            flags.complete(slot, seq, b"", lib.HF_ROUND_BAD)
            continue
        try:
            reply, result = adapter.round(request, deadline_s), lib.HF_ROUND_OK
        except TimeoutError:
            reply, result = b"", lib.HF_ROUND_TIMEOUT
        except Exception:  # noqa: BLE001 - a failed round is reported to the engine, not fatal
            reply, result = b"", lib.HF_ROUND_FAILED
        if len(reply) > flags.slot_bytes:
            reply, result = b"", lib.HF_ROUND_BAD
        flags.complete(slot, seq, reply, result)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m async_handoff.proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--region", required=True, help="path of the host-flags region")
    p.add_argument("--generation", type=int, required=True)
    p.add_argument("--adapter", required=True, help="module:Class performing one round")
    p.add_argument("--adapter-config", default="{}", help="JSON handed to the adapter")
    p.add_argument("--mode", choices=["spin", "nap"], default="nap")
    p.add_argument("--spin-us", type=float, default=50)
    p.add_argument("--round-deadline-ms", type=float, default=100)
    p.add_argument("--heartbeat-ms", type=float, default=100)
    p.add_argument("--cpus", default="", help="CPUs to run on, like 3 or 2,5-6 (default: the "
                   "engine's)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
