"""remote_engram: DeepSeek-V4.1 Engram tables (layers 1 and 14) served from an offload
host's RAM over ofl, with the local shard as an exact fallback.

Geometry and hashing (geometry.py, hashing.py), the compressed token map (token_map.py),
the shard format (shard.py), packing and synthetic tables (pack.py, synth.py), the server
(server.py), the client (client.py), qualification (qualify.py), test helpers (testing.py).
Torch-free; torch is used only by the `vllm` subpackage and dequant's bf16 path.
"""

from .client import EngramClient
from .geometry import V41, EngramGeometry
from .hashing import row_ids
from .shard import ShardReader, ShardWriter, shard_name

__version__ = "0.1.0"
__all__ = ["V41", "EngramClient", "EngramGeometry", "ShardReader", "ShardWriter", "row_ids",
           "shard_name"]
