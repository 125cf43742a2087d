import os
import sys

import pytest

# remote-drafter's test helpers build the tiny target and drafters (shared, not copied).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "remote-drafter", "tests"))

from drafter_support import make_models  # noqa: E402


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return make_models(str(tmp_path_factory.mktemp("tp2-models")))


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    """Every test gets its own lock folder (the ranks inherit it)."""
    folder = str(tmp_path / "locks")
    monkeypatch.setenv("REMOTE_DRAFTER_LOCK_DIR", folder)
    return folder
