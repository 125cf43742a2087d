import sys

import pytest

import remote_drafter.testing
from remote_drafter.testing import make_models

# test_tp2_parity.py and test_tp2_faults.py import remote-drafter's helpers by the name they
# had in its tests folder: the same module under that name until they import it as
# remote_drafter.testing.
sys.modules.setdefault("drafter_support", remote_drafter.testing)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return make_models(str(tmp_path_factory.mktemp("tp2-models")))


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    """Every test gets its own lock folder (the ranks inherit it)."""
    folder = str(tmp_path / "locks")
    monkeypatch.setenv("REMOTE_DRAFTER_LOCK_DIR", folder)
    return folder
