"""Every environment variable drafter_tp2 reads, with its default and what it does.

Read when a worker rank or the supervisor starts; changing one while a worker runs does
nothing until it restarts. Rollback to the one-card worker: README, "Rollback". The device locks (shared with the
one-card worker) are configured by remote_drafter.env: REMOTE_DRAFTER_LOCK_DIR.
"""

from __future__ import annotations

from ofl.env import EnvVar

DRAFTER_TP2_MASTER = EnvVar(
    "DRAFTER_TP2_MASTER", "127.0.0.1:0",
    "HOST:PORT where the two ranks meet (torch.distributed TCP store); port 0 = a free one "
    "picked by the `worker` command.",
    kind="address")
DRAFTER_TP2_START_TIMEOUT_S = EnvVar(
    "DRAFTER_TP2_START_TIMEOUT_S", "120",
    "How long a rank waits for its peer to join at start-up before giving up.",
    kind="number")
DRAFTER_TP2_TIMEOUT_S = EnvVar(
    "DRAFTER_TP2_TIMEOUT_S", "10",
    "Deadline of one collective (a round's all-reduce, a heartbeat): a peer that is dead or "
    "hung for longer stops the pair.",
    kind="number")
DRAFTER_TP2_HEARTBEAT_S = EnvVar(
    "DRAFTER_TP2_HEARTBEAT_S", "1",
    "Idle heartbeat between the ranks (must be well under DRAFTER_TP2_TIMEOUT_S): a peer "
    "that died between rounds is noticed within about this long.",
    kind="number")
DRAFTER_TP2_REQUIRE_P2P = EnvVar(
    "DRAFTER_TP2_REQUIRE_P2P", "1",
    "CUDA: 1 = refuse to serve unless the two GPUs can access each other (P2P); 0 = serve "
    "anyway (NCCL then goes through host memory; slower). Ignored on CPU.",
    kind="flag")
DRAFTER_TP2_CUDA_GRAPHS = EnvVar(
    "DRAFTER_TP2_CUDA_GRAPHS", "auto",
    "auto = on CUDA, capture the decode round as CUDA graphs on an owned stream at start-up "
    "(batch buckets below); 0 = eager rounds. CPU: always eager. Untested on GPU until "
    "benchmarks/gpu.sh has run.",
    choices=("auto", "0"))
DRAFTER_TP2_GRAPH_BATCHES = EnvVar(
    "DRAFTER_TP2_GRAPH_BATCHES", "1,2,4,8,16",
    "Batch sizes captured as graphs; a round is padded up to the next one; larger rounds "
    "run eagerly.")
DRAFTER_TP2_RESTARTS = EnvVar(
    "DRAFTER_TP2_RESTARTS", "3",
    "Supervisor: restarts allowed within DRAFTER_TP2_RESTART_WINDOW_S before it gives up.",
    kind="int")
DRAFTER_TP2_RESTART_WINDOW_S = EnvVar(
    "DRAFTER_TP2_RESTART_WINDOW_S", "300", "Supervisor: the window of the restart bound.",
    kind="number")

ALL = [DRAFTER_TP2_MASTER, DRAFTER_TP2_START_TIMEOUT_S,
       DRAFTER_TP2_TIMEOUT_S, DRAFTER_TP2_HEARTBEAT_S, DRAFTER_TP2_REQUIRE_P2P,
       DRAFTER_TP2_CUDA_GRAPHS, DRAFTER_TP2_GRAPH_BATCHES, DRAFTER_TP2_RESTARTS,
       DRAFTER_TP2_RESTART_WINDOW_S]
