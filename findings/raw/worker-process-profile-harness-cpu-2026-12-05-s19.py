"""Session 19: py-spy (2 kHz, 25 s) on a stub worker in its own process while a client drives
batch-16 rounds over tcp loopback; writes /tmp/spy-worker.txt (py-spy's raw stacks). Needs
py-spy at /tmp/spyenv/bin/py-spy (python3 -m venv /tmp/spyenv && /tmp/spyenv/bin/pip install
py-spy). From the repository root."""
# ruff: noqa
import subprocess, sys, time
sys.path.insert(0, "packages/remote-drafter/benchmarks")
import worker_cost as W
from dsv41_gpu import worker_process
from remote_drafter.bench import drive_rounds
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import Manifest
from remote_drafter.engine.transport import RemoteTransport
d = W.stub_drafter("bfloat16")
proc, address = worker_process("packages/remote-drafter/benchmarks/worker_cost.py", "stub", "bfloat16")
client = DrafterClient(RemoteTransport(address, "tcp", Manifest()), f"64:{d.max_depth}", deadline_s=30.0, row_dtype="bfloat16")
drive_rounds(client, 16, 50, d.max_depth, d.vocab_size, d.feature, "sync", 0.0, seed=16, row_dtype="bfloat16", warm_rounds=W.in_service(d.window))
spy = subprocess.Popen(["/tmp/spyenv/bin/py-spy", "record", "-r", "2000", "-f", "raw", "-o", "/tmp/spy-worker.txt", "-p", str(proc.pid), "-d", "25"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1)
t = time.time()
n = 0
while time.time() - t < 20:
    drive_rounds(client, 16, 100, d.max_depth, d.vocab_size, d.feature, "sync", 0.0, seed=16 + n, row_dtype="bfloat16", warm_rounds=0)
    n += 1
spy.wait()
client.close(); proc.stdin.close(); proc.wait()
print("done", n)
