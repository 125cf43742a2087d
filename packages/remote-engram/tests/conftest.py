import pytest

from remote_engram.synth import write_shards
from remote_engram.testing import SMALL, EngramServeProcess


@pytest.fixture(scope="session")
def shard_dirs(tmp_path_factory):
    """Two table sets of the same geometry: seed 0 (the real one) and seed 1 (different)."""
    base = tmp_path_factory.mktemp("engram")
    dirs = {}
    for seed in (0, 1):
        d = str(base / f"seed{seed}")
        write_shards(d, SMALL, nranks=2, seed=seed)
        dirs[seed] = d
    return dirs


@pytest.fixture(params=["tcp", "shm"])
def engram_server(request, shard_dirs):
    srv = EngramServeProcess(shard_dirs[0], request.param)
    yield srv
    srv.stop()
