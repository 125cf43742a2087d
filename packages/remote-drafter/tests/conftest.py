import pytest
from drafter_support import make_models


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return make_models(str(tmp_path_factory.mktemp("drafter-models")))
