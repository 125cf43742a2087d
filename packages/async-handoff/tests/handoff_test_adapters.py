"""Adapters the tests name in the proxy's configuration (imported inside the proxy)."""

import os
import time


class SlowEchoAdapter:
    """Echoes after config["delay_s"]; honours the round deadline like a real adapter."""

    def __init__(self, config):
        self.delay = config.get("delay_s", 0.0)

    def connect(self):
        return "slow echo"

    def round(self, request, deadline_s):
        if self.delay > deadline_s:
            time.sleep(deadline_s)
            raise TimeoutError("late")
        time.sleep(self.delay)
        return request

    def close(self):
        pass


class ConstantAdapter:
    """Answers every round with the same bytes: a peer that is not an echo server (a drafter
    worker answering garbage requests, say)."""

    def __init__(self, config):
        pass

    def connect(self):
        return "constant"

    def round(self, request, deadline_s):
        return b"not an echo"

    def close(self):
        pass


class CrashAdapter:
    """Kills its own process on the first round (a proxy that keeps dying)."""

    def __init__(self, config):
        pass

    def connect(self):
        return "crash"

    def round(self, request, deadline_s):
        os._exit(3)

    def close(self):
        pass


class TorchAdapter:
    """Imports torch at connect: the proxy's self-test must refuse to serve."""

    def __init__(self, config):
        pass

    def connect(self):
        import torch  # noqa: F401

        return "torch"

    def round(self, request, deadline_s):
        return request

    def close(self):
        pass
