"""`async-handoff`: check the handoff on this host before enabling it.

  async-handoff selftest --adapter async_handoff.adapters:OflMessageAdapter \\
      --adapter-config '{"address": "10.0.0.2:7490", "backend": "tcp"}' --rounds 2048
  async-handoff counters --listen 127.0.0.1:9496   # a running engine's handoff counters
  async-handoff env
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ofl.env import describe

from . import env
from .handoff import Handoff, HandoffConfig


def cmd_selftest(args) -> int:
    h = Handoff(HandoffConfig.from_env(), args.adapter, json.loads(args.adapter_config))
    t = time.perf_counter()
    h.start()
    print(f"proxy: {json.dumps(h.proxy_status)}")
    print(f"started in {time.perf_counter() - t:.2f} s; host flags mlock "
          f"{'ok' if h.metrics.mlocked._value.get() else 'FAILED'}")
    if not h.enabled:
        print(f"NOT ready: {h.reason}")
        h.close()
        return 1
    failed = 0
    for i in range(args.rounds):
        payload = i.to_bytes(8, "little")
        ticket = h.submit(payload)
        reply = None
        end = time.monotonic() + h.config.round_deadline_ms / 1000
        while reply is None and time.monotonic() < end:
            reply = h.wait(ticket)
        failed += reply is None
    c = h.counters()
    h.close()
    print(f"{args.rounds} rounds: {int(c['rounds_ok'])} ok, {failed} without a reply; "
          f"watchdog fires {int(c['watchdog_fires'])}, respawns {int(c['respawns'])}")
    return 0 if failed == 0 and c["watchdog_fires"] == 0 else 1


def cmd_counters(args) -> int:
    from .exposition import read
    try:
        print(json.dumps(read(args.listen), indent=2))
    except OSError as exc:
        print(f"async-handoff counters: nothing answers at {args.listen} ({exc}); is the engine "
              "running with ASYNC_HANDOFF_METRICS_LISTEN set to it?", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="async-handoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("selftest", help="start a proxy, run rounds through it, report")
    s.add_argument("--adapter", default="async_handoff.adapters:NullAdapter")
    s.add_argument("--adapter-config", default="{}")
    s.add_argument("--rounds", type=int, default=2048)
    s.set_defaults(func=cmd_selftest)
    c = sub.add_parser("counters", help="a running Handoff's counters (ASYNC_HANDOFF_METRICS_LISTEN)",
                       description="Read the counters an engine's Handoff serves on "
                       "ASYNC_HANDOFF_METRICS_LISTEN: rounds ok/failed/timed out/bad, stale "
                       "replies, watchdog fires, respawns, enabled, mlocked (JSON).")
    c.add_argument("--listen", required=True, help="HOST:PORT of ASYNC_HANDOFF_METRICS_LISTEN")
    c.set_defaults(func=cmd_counters)
    e = sub.add_parser("env", help="the environment variables read, with defaults")
    e.set_defaults(func=lambda a: print(describe(env.ALL)) or 0)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
