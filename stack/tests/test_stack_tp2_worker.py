"""The offload host's two-card worker on CPU (a gloo pair, tiny DSpark drafter): `up
--role drafter-worker` with STACK_DRAFTER_TP2=1 serves the engine's expected identities
with a TP2 topology; `rollback tp2-worker` applied by restarting the worker alone brings
the one-card worker on the same address with the same identities; nothing left running."""

import subprocess

from dsv41_stack.config import StackConfig
from dsv41_stack.deployment import Deployment
from dsv41_stack.preflight import check_drafter_identity
from dsv41_stack.rollback import rollback
from longctx_bench.launch import free_port
from remote_drafter.testing import make_models


def described(address: str) -> dict:
    from remote_drafter.engine.transport import RemoteTransport
    transport = RemoteTransport(address, "tcp")
    try:
        return transport.info(10).described
    finally:
        transport.close()


def test_two_card_worker_up_and_rolled_back_to_one_card(tmp_path):
    models = make_models(str(tmp_path / "models"))
    address = f"127.0.0.1:{free_port()}"
    cfg = StackConfig({"STACK_RUN_DIR": str(tmp_path / "run"), "STACK_DRAFTER": models["dspark"],
                       "STACK_DRAFTER_TARGET": models["target"], "STACK_DRAFTER_LISTEN": address,
                       "STACK_DRAFTER_TP2": "1", "STACK_DRAFTER_DEVICES": "cpu:0,cpu:1",
                       "REMOTE_DRAFTER_BACKEND": "tcp", "REMOTE_DRAFTER_TARGET": models["target"],
                       # the CPU pair's device locks in a folder of this test's (the env file
                       # reaches the worker, not only the engine)
                       "REMOTE_DRAFTER_LOCK_DIR": str(tmp_path / "locks")})
    said = []
    pair = Deployment(cfg)
    try:
        pair.up("drafter-worker", say=said.append, timeout_s=180)
        two = described(address)
        assert two["drafter"]["topology"]["tp"] == 2, two["drafter"]
        assert check_drafter_identity(address, cfg).ok  # what an engine expects
        assert "error" not in pair.status("drafter-worker")["drafter-worker"]
        assert list((tmp_path / "locks").iterdir())  # the pair's locks, where the env file says
        one_card = Deployment(rollback(cfg, "tp2-worker"))
        pair.down("drafter-worker", say=said.append)  # the worker alone restarts
        one_card.up("drafter-worker", say=said.append, timeout_s=180)
        one = described(address)
        assert "topology" not in one["drafter"]
        assert one["manifest"] == two["manifest"]  # the same identities: engines need no change
        assert check_drafter_identity(address, cfg).ok
        assert one_card.status()["drafter-worker"]["running"]
    finally:
        for d in (pair, Deployment(rollback(cfg, "tp2-worker"))):
            d.down("drafter-worker", say=said.append)
    assert not list((tmp_path / "run" / "pids").iterdir())
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left running: {left}\n{said}"
