import pytest
from drafter_support import make_models

from remote_drafter.target import TargetLM


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return make_models(str(tmp_path_factory.mktemp("drafter-models")))


@pytest.fixture(scope="session")
def target(models):
    return TargetLM.load(models["target"])
