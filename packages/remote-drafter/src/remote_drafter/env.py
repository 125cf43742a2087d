"""Every environment variable remote_drafter reads, with its default and what it does.

Read when a client or the worker starts; changing one in a running engine does nothing
until it restarts. Rollback of remote drafting: unset REMOTE_DRAFTER_ADDRESS (and
REMOTE_DRAFTER_CAPACITY_MODE), restore the baseline KV budget, restart -> local drafter.
"""

from __future__ import annotations

from ofl.env import EnvVar

REMOTE_DRAFTER_ADDRESS = EnvVar(
    "REMOTE_DRAFTER_ADDRESS", "",
    "Drafter worker HOST:PORT; empty = the drafter runs locally in the engine's process.",
    kind="address")
REMOTE_DRAFTER_STANDBYS = EnvVar(
    "REMOTE_DRAFTER_STANDBYS", "",
    "Standby drafter workers, HOST:PORT comma-separated: when the worker rounds go to stops "
    "answering, they go to the next of REMOTE_DRAFTER_ADDRESS (the primary) and these, each "
    "checked like the primary (target, tokenizer, drafter); requests re-open there with "
    "their windows. Empty = the primary alone.")
REMOTE_DRAFTER_BACKEND = EnvVar(
    "REMOTE_DRAFTER_BACKEND", "tcp", "ofl backend of the drafter link: tcp, shm or verbs.",
    choices=("tcp", "shm", "verbs"))
REMOTE_DRAFTER_DEADLINE_MS = EnvVar(
    "REMOTE_DRAFTER_DEADLINE_MS", "50",
    "Deadline of one synchronous draft round; past it this step has no drafts (counted).",
    kind="number")
REMOTE_DRAFTER_DEPTH = EnvVar(
    "REMOTE_DRAFTER_DEPTH", "1:5,8:4,16:3,32:2,64:0",
    "Batch-aware depth: 'running:k' pairs; a step with R running requests drafts k tokens "
    "from the first pair whose bound is >= R (past the last pair: 0 = no drafts).")
REMOTE_DRAFTER_CAPACITY_MODE = EnvVar(
    "REMOTE_DRAFTER_CAPACITY_MODE", "0",
    "1 = the drafter's memory went to KV cache: the engine never creates a local drafter; "
    "with the worker gone it decodes target-only until the worker is back.",
    kind="flag")
REMOTE_DRAFTER_MANIFEST = EnvVar(
    "REMOTE_DRAFTER_MANIFEST", "",
    "Path of the identity manifest (JSON from `remote-drafter identity`) the worker must "
    "match; empty = match the target and tokenizer digests only.")
REMOTE_DRAFTER_TARGET = EnvVar(
    "REMOTE_DRAFTER_TARGET", "",
    "The target checkpoint folder (its weights' and tokenizer's digests are the identity the "
    "worker must have been built for; the local drafter takes embedding and head from it).")
REMOTE_DRAFTER_DRAFTER = EnvVar(
    "REMOTE_DRAFTER_DRAFTER", "",
    "Local mode: the drafter ('dsv41:DIR', a DSpark checkpoint folder, 'ngram', or "
    "'module:Class').")

REMOTE_DRAFTER_HIDDEN_LAYERS = EnvVar(
    "REMOTE_DRAFTER_HIDDEN_LAYERS", "auto",
    "vLLM: the target layers whose hidden rows the drafter reads, comma-separated (0 = the "
    "output of the first decoder layer), or 'auto' = ask the drafter at engine start-up (the "
    "local one, or the worker). A worker reading other layers is refused.")

REMOTE_DRAFTER_VLLM_COLLECT = EnvVar(
    "REMOTE_DRAFTER_VLLM_COLLECT", "input",
    "vLLM, asynchronous rounds: input = vLLM takes placeholder drafts and the round's real "
    "drafts are written into the next step's inputs (the round overlaps the host work in "
    "between; a round late or failed leaves the placeholders, which verification rejects); "
    "take = collect when vLLM takes the drafts (the rollback).",
    choices=("input", "take"))
REMOTE_DRAFTER_METRICS_LISTEN = EnvVar(
    "REMOTE_DRAFTER_METRICS_LISTEN", "",
    "vLLM: HOST:PORT of each engine rank's proposer /metrics and /health (rank r on PORT + r): "
    "the client's and the proposer's counters; empty = not served.",
    kind="address")

REMOTE_DRAFTER_MAX_REQUESTS_PER_CLIENT = EnvVar(
    "REMOTE_DRAFTER_MAX_REQUESTS_PER_CLIENT", "auto",
    "Worker: requests one client may hold at once, a client being one peer address (all its "
    "connections and client ids: every engine rank on that host); auto = half of "
    "--max-requests, so no one host takes every slot. Opens past it get status 'quota'. The "
    "worker's --max-requests-per-client overrides it.",
    kind="int", choices=("auto",))
REMOTE_DRAFTER_MAX_HISTORY_BYTES_PER_CLIENT = EnvVar(
    "REMOTE_DRAFTER_MAX_HISTORY_BYTES_PER_CLIENT", "auto",
    "Worker: bytes of history one client (one peer address) may hold, each request charged "
    "what its history can grow to (bytes_per_request) when it opens, so no continue is ever "
    "refused; auto = no bound beyond the request quota. The worker's "
    "--max-history-bytes-per-client overrides it.",
    kind="int", choices=("auto",))
REMOTE_DRAFTER_CONFIDENCE_CUTOFF = EnvVar(
    "REMOTE_DRAFTER_CONFIDENCE_CUTOFF", "0",
    "Worker, dsv41 drafter: cut each draft before its first token the checkpoint's confidence "
    "head scores below this (0..1); 0 = off, the whole draft is sent.",
    kind="number")
REMOTE_DRAFTER_CUDA_GRAPHS = EnvVar(
    "REMOTE_DRAFTER_CUDA_GRAPHS", "auto",
    "Worker, dsv41 drafter on CUDA with dense weights: auto = run each row's chosen experts "
    "through grouped GEMMs on the device (torch._grouped_mm, bf16 weights; other dtypes, or "
    "where it does not run, capture or match: "
    "every expert on every row, routing weights zero where not chosen, the same sum) and "
    "capture the round's forward as CUDA graphs for batches 1, 2, 4, 8, 16 at start-up; 0 = "
    "eager, the chosen experts one by one. EXL3 weights: auto = captured the same way when the experts run "
    "through exllamav3's fused kernels (the chosen experts only, no host read of the routing), "
    "eager when they run per matrix (status says which: `experts`); 1 = captured either way "
    "(per matrix: each served expert on every row).",
    choices=("auto", "0", "1"))
REMOTE_DRAFTER_EXL3_EXPERTS = EnvVar(
    "REMOTE_DRAFTER_EXL3_EXPERTS", "auto",
    "Worker, dsv41 drafter with EXL3 weights on CUDA: what runs each MoE layer's experts. "
    "exllamav3 = its fused kernels at every row count; ours = our Triton kernel (each chosen "
    "expert decoded once for every 16 rows that chose it, on the tensor cores; its configuration "
    "tuned at start-up per row count the rounds run) at every row count; auto = ours tuned, "
    "then both timed at those row counts, the faster serving each (status `experts`). Ours "
    "serves 4-bit mul1 packs with unpadded dimensions; otherwise exllamav3's kernels do, with a "
    "warning.",
    choices=("auto", "ours", "exllamav3"))
REMOTE_DRAFTER_EXL3_DENSE_MIB = EnvVar(
    "REMOTE_DRAFTER_EXL3_DENSE_MIB", "1024",
    "Worker, dsv41 drafter with EXL3 weights on CUDA: GPU memory (MiB) for dense fp16 copies of "
    "the quantised linears outside the routed experts (attention, the taps' projection, each "
    "layer's shared expert, an EXL3 head). "
    "At start-up each is timed against exllamav3's kernel at the row counts the rounds run; a "
    "copy serves from the row count where it is faster, those saving the most time per byte "
    "first, within this budget (status `exl3_dense`). Same weights, more bytes read: it pays "
    "where the GPU's arithmetic, not its memory, bounds the kernel. 0 = the kernels only.",
    kind="int")
REMOTE_DRAFTER_ATTENTION = EnvVar(
    "REMOTE_DRAFTER_ATTENTION", "auto",
    "Worker, dsv41 drafter on CUDA with the round's kernels: the form of the window's attention "
    "kernel. auto = at start-up every form that matches torch's attention (the kernel's "
    "defaults; the keys split over several programs a block of query rows; the weighted sum on "
    "the tensor cores) is timed at each batch the rounds are "
    "captured for, the fastest serving there (status `attention`); default = the kernel's "
    "defaults at every batch (the same form on every card).",
    choices=("auto", "default"))
REMOTE_DRAFTER_DEVICE_LOCK = EnvVar(
    "REMOTE_DRAFTER_DEVICE_LOCK", "auto",
    "Worker: auto = hold an exclusive lifetime lock on the worker's GPU (keyed by its UUID) "
    "before loading anything onto it, so no second drafter worker of any kind (one-card or "
    "drafter-tp2) can take the card; 1 = lock CPU 'devices' too (tests); 0 = no lock.",
    choices=("auto", "0", "1"))
REMOTE_DRAFTER_LOCK_DIR = EnvVar(
    "REMOTE_DRAFTER_LOCK_DIR", "",
    "Folder of the device locks (one file per GPU UUID), shared by the one-card worker and "
    "drafter-tp2's ranks; empty = $XDG_RUNTIME_DIR, else /run/lock if writable, else the "
    "temp folder. Every worker on the host must see the same folder for the locks to "
    "exclude each other.")

ALL = [REMOTE_DRAFTER_ADDRESS, REMOTE_DRAFTER_STANDBYS, REMOTE_DRAFTER_BACKEND, REMOTE_DRAFTER_DEADLINE_MS,
       REMOTE_DRAFTER_DEPTH, REMOTE_DRAFTER_CAPACITY_MODE, REMOTE_DRAFTER_MANIFEST,
       REMOTE_DRAFTER_TARGET, REMOTE_DRAFTER_DRAFTER, REMOTE_DRAFTER_HIDDEN_LAYERS,
       REMOTE_DRAFTER_VLLM_COLLECT, REMOTE_DRAFTER_METRICS_LISTEN, REMOTE_DRAFTER_DEVICE_LOCK,
       REMOTE_DRAFTER_LOCK_DIR, REMOTE_DRAFTER_MAX_REQUESTS_PER_CLIENT,
       REMOTE_DRAFTER_MAX_HISTORY_BYTES_PER_CLIENT, REMOTE_DRAFTER_CONFIDENCE_CUTOFF,
       REMOTE_DRAFTER_CUDA_GRAPHS, REMOTE_DRAFTER_EXL3_EXPERTS, REMOTE_DRAFTER_EXL3_DENSE_MIB,
       REMOTE_DRAFTER_ATTENTION]


def capacity_mode() -> bool:
    return REMOTE_DRAFTER_CAPACITY_MODE.get() not in ("", "0")


def standbys() -> tuple[str, ...]:
    """REMOTE_DRAFTER_STANDBYS as a list of addresses."""
    return tuple(a.strip() for a in REMOTE_DRAFTER_STANDBYS.get().split(",") if a.strip())
