"""Rank 0 -> rank 1: each round's inputs, heartbeats and the stop order.

A command header travels on the control group (gloo, CPU tensors, so a heartbeat never
waits behind GPU work); the round's tensors on the data group (NCCL on GPUs, the same gloo
group on CPU). Every collective has the pair's deadline: a dead peer fails it at once
(connection closed), a hung one when the deadline passes. The first failure breaks the
channel for good (a half-done collective leaves the group unusable): every later call
raises PairBroken at once, and `on_broken` is told why (rank 0 stops serving)."""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

log = logging.getLogger("drafter_tp2.channel")

ROUND, PING, STOP = 1, 2, 3
HEADER = 5  # cmd, batch, context positions, reserved x 2


class PairBroken(RuntimeError):
    """The other rank died, hung past the deadline or stopped: the pair cannot serve."""


class Channel:
    """blank(b, c) -> zero tensors shaped and typed as a round's inputs for b requests over c
    context positions (the drafter kind's: rank 1 receives into them)."""

    def __init__(self, rank: int, ctrl, data, device: str, blank, on_broken=None):
        self.rank, self.ctrl, self.data, self.device = rank, ctrl, data, device
        self.blank, self.on_broken = blank, on_broken
        self.broken: str | None = None
        self._lock = threading.Lock()  # a heartbeat and a round never interleave collectives

    def _fail(self, what: str, exc: BaseException) -> PairBroken:
        if self.broken is None:
            self.broken = f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.error("rank %d: the pair is broken: %s", self.rank, self.broken)
            if self.on_broken is not None:
                self.on_broken(self.broken)
        return PairBroken(self.broken)

    def _check(self) -> None:
        if self.broken is not None:
            raise PairBroken(self.broken)

    def _header(self, values: list[int] | None = None) -> list[int]:
        h = torch.tensor(values or [0] * HEADER, dtype=torch.int64)
        dist.broadcast(h, 0, group=self.ctrl)
        return h.tolist()

    # -- rank 0 -------------------------------------------------------------------------------
    def send_round(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Broadcast the round's inputs (their second is [b, c]: the context's validity, or
        DeepSeek's [b, 3] of rows kept, seed and position, whose kind ignores c);
        the caller then runs the round's collectives (the model's) under `self.round()`."""
        b, c = inputs[1].shape
        self._header([ROUND, b, c, 0, 0])
        for t in inputs:
            dist.broadcast(_sendable(t).contiguous(), 0, group=self.data)

    def round(self, inputs, run):
        """Rank 0: one round, both ranks: send, then run(inputs) (the sharded forward)."""
        with self._lock:
            self._check()
            try:
                self.send_round(inputs)
                return run(inputs)
            except Exception as exc:  # noqa: BLE001 - any collective failure breaks the pair
                raise self._fail("a round", exc) from exc

    def ping(self) -> None:
        """Rank 0's heartbeat: both ranks take part in a tiny all-reduce (a hung peer times out)."""
        with self._lock:
            self._check()
            try:
                self._header([PING, 0, 0, 0, 0])
                ack = torch.ones(1)
                dist.all_reduce(ack, group=self.ctrl)
                if int(ack.item()) != 2:
                    raise RuntimeError(f"heartbeat sum {ack.item()} != 2")
            except Exception as exc:  # noqa: BLE001
                raise self._fail("the heartbeat", exc) from exc

    def stop(self) -> None:
        """Tell rank 1 to finish (it releases its device lock after its GPU work)."""
        with self._lock:
            if self.broken is None:
                try:
                    self._header([STOP, 0, 0, 0, 0])
                except Exception as exc:  # noqa: BLE001 - stopping anyway
                    self._fail("the stop order", exc)
                self.broken = "stopped"

    # -- rank 1 -------------------------------------------------------------------------------
    def follow(self, run) -> str:
        """Rank 1's loop: receive each round and run it, until the stop order or a failure.
        Returns why it ended ('stopped' or the failure)."""
        while True:
            try:
                cmd, b, c, _, _ = self._header()
                if cmd == STOP:
                    return "stopped"
                if cmd == PING:
                    dist.all_reduce(torch.ones(1), group=self.ctrl)
                    continue
                if cmd != ROUND:
                    raise RuntimeError(f"unknown command {cmd} from rank 0")
                inputs = self.receive_round(b, c)
                run(inputs)
            except Exception as exc:  # noqa: BLE001 - rank 0 gone, hung or the round failed
                return str(self._fail("following rank 0", exc))

    def receive_round(self, b: int, c: int) -> tuple[torch.Tensor, ...]:
        inputs = []
        for t in self.blank(b, c):
            buf = _sendable(t)
            dist.broadcast(buf, 0, group=self.data)
            inputs.append(buf.bool() if t.dtype == torch.bool else buf)
        return tuple(inputs)


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """Booleans travel as bytes (not every backend broadcasts bool)."""
    return t.to(torch.uint8) if t.dtype == torch.bool else t
