import pytest

from remote_drafter.testing import make_models


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return make_models(str(tmp_path_factory.mktemp("tp2-models")))


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    """Every test gets its own lock folder (the ranks inherit it)."""
    folder = str(tmp_path / "locks")
    monkeypatch.setenv("REMOTE_DRAFTER_LOCK_DIR", folder)
    return folder
