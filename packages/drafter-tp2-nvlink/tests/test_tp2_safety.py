"""Pair safety and lifetime device locks: refusals with their reasons, a held device
refused (by another pair or by a one-card worker, both ways), the locks released only at
the end. The lock itself (dead holders, exclusion) is tested in remote-drafter, whose
module both kinds of worker use."""

import subprocess
import sys

from drafter_tp2.launcher import free_master
from drafter_tp2.pair import refusals
from drafter_tp2.testing import PairProcess, RankPair, drafter_tp2, tp2_env, worker_args
from remote_drafter.models.dspark import DSparkDrafter
from remote_drafter.worker.device_lock import DeviceLock, device_key
from remote_drafter.worker.server import spawn_worker


def run_worker(args, env) -> tuple[int, str]:
    p = drafter_tp2("worker", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = p.communicate(timeout=90)
    return p.returncode, out + err


def test_the_same_device_twice_is_refused(models, lock_dir):
    code, text = run_worker(worker_args(models, "cpu:0,cpu:0"), tp2_env())
    assert code == 2
    assert "refusing to serve: the same device twice: ['cpu:0', 'cpu:0']" in text, text


def test_a_port_already_taken_is_a_refusal_not_a_crash(models, lock_dir):
    """Exit 2 (the supervisor does not restart it: a restart would find the port taken again),
    with the address and the cause."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        args = worker_args(models)
        args[args.index("--listen") + 1] = address
        code, text = run_worker(args, tp2_env())
    assert code == 2, text
    assert f"refusing to serve on {address}: [Errno 98] Address already in use" in text, text


def test_the_pair_check_names_the_same_device_twice():
    info = {"key": "GPU-abc", "device": "cuda:0", "fingerprint": "f" * 32, "source": "d",
            "config": {"dtype": "float32"}, "torch": "2.11", "peer": {"p2p": True, "text": ""}}
    why = refusals([{**info, "rank": 0}, {**info, "rank": 1, "device": "cuda:1"}], True)
    assert why == ["the same device twice: both ranks are on GPU-abc (cuda:0, cuda:1)"]
    no_p2p = {**info, "peer": {"p2p": False, "text": "P2P no"}}
    why = refusals([{**no_p2p, "rank": 0}, {**no_p2p, "rank": 1, "key": "GPU-def"}], True)
    assert len(why) == 2 and all("no P2P access" in w for w in why)
    assert refusals([{**no_p2p, "rank": 0}, {**no_p2p, "rank": 1, "key": "GPU-def"}], False) == []


def test_different_weights_are_refused_by_both_ranks(models, lock_dir, tmp_path):
    other = str(tmp_path / "other")
    config = DSparkDrafter.load(models["dspark"], models["target"]).config
    DSparkDrafter.create(other, models["target"], config, seed=5, init_std=0.3)  # same shape, other weights
    args = worker_args(models)
    args1 = [other if a == models["dspark"] else a for a in args]
    pair = RankPair(args, free_master("127.0.0.1:0"), args1=args1)
    try:
        (c0, e0), (c1, e1) = pair.wait(timeout=90)
    finally:
        pair.kill()
    assert (c0, c1) == (2, 2), (e0, e1)
    for text in (e0, e1):
        assert "refusing to serve: different weights: rank 0 loaded" in text, text
        assert other in text


def test_a_different_configuration_or_torch_is_refused():
    info = {"key": "k0", "device": "cpu:0", "fingerprint": "f" * 32, "source": "d",
            "config": {"dtype": "float32", "timeout_s": 10.0}, "torch": "2.13.0",
            "peer": {"p2p": None, "text": "cpu, no peer link"}}
    other = {**info, "rank": 1, "key": "k1", "torch": "2.11.0",
             "config": {"dtype": "bfloat16", "timeout_s": 10.0}}
    assert refusals([{**info, "rank": 0}, other], True) == [
        "different configuration: dtype 'float32' vs 'bfloat16'",
        "different torch builds: 2.13.0 vs 2.11.0"]


def test_a_held_device_refuses_a_second_worker_until_released(models, lock_dir):
    first = PairProcess(worker_args(models, "cpu:0,cpu:1"), tp2_env())
    try:
        code, text = run_worker(worker_args(models, "cpu:2,cpu:1"), tp2_env())
        assert code == 2
        assert f"device {device_key('cpu:1')} is in use" in text, text
        assert f"locked by pid {first.rank_pids[1]}" in text, text
    finally:
        first.stop()
    said = first.proc.stderr.read()  # the launcher's and the ranks' log: why, if a rank was killed
    assert first.proc.returncode == 0, said
    for dev in ("cpu:0", "cpu:1"):  # released at the end, with no record left behind
        lock = DeviceLock(device_key(dev), lock_dir).acquire()
        assert lock.cleared is None, (dev, lock.cleared, said)
        lock.release()


def test_an_exposed_listener_without_admission_is_refused_before_the_ranks_load(models, lock_dir):
    """As the one-card worker: an address other hosts can reach needs OFL_ALLOW or a key, or
    --insecure; without them the launcher refuses with ofl's one line before either rank
    starts (no load, no device locked), and exits 2 (the supervisor does not restart a
    refusal)."""
    no_admission = {name: "" for name in ("OFL_ALLOW", "OFL_AUTH_KEY", "OFL_AUTH_KEY_FILE",
                                          "OFL_INSECURE")}
    code, text = run_worker(worker_args(models, "cpu:0,cpu:1", "--listen", "0.0.0.0:0"),
                            tp2_env(**no_admission))
    assert code == 2, text
    assert text.strip().splitlines() == [next(line for line in text.splitlines() if line)]
    assert text.startswith("drafter-tp2 worker: refusing to listen on 0.0.0.0"), text
    assert "OFL_ALLOW" in text and "--insecure" in text and "rank" not in text
    for dev in ("cpu:0", "cpu:1"):  # never taken
        lock = DeviceLock(device_key(dev), lock_dir).acquire()
        assert lock.cleared is None
        lock.release()


def test_one_card_and_tp2_workers_exclude_each_other(models, lock_dir):
    one_card = ["--drafter", models["dspark"], "--target", models["target"], "--listen", "127.0.0.1:0"]
    env = tp2_env(REMOTE_DRAFTER_DEVICE_LOCK="1")  # lock CPU 'devices' as auto locks GPUs
    pair = PairProcess(worker_args(models, "cpu:0,cpu:1"), env)
    try:
        refused = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "worker", *one_card,
                                  "--device", "cpu:1"], capture_output=True, text=True, env=env,
                                 timeout=90)
        assert refused.returncode == 2, refused
        assert f"locked by pid {pair.rank_pids[1]}" in refused.stderr, refused.stderr
    finally:
        pair.stop()
    single, _ = spawn_worker([*one_card, "--device", "cpu:1"], env=env)
    try:
        code, text = run_worker(worker_args(models, "cpu:0,cpu:1"), env)
        assert code == 2 and f"locked by pid {single.pid}" in text, text
    finally:
        single.terminate()
        single.wait(timeout=30)
