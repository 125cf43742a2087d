import pytest


# The models need torch: imported when a test asks for them, so the torch-free modules
# collect where torch is not installed.
@pytest.fixture(scope="session")
def models(tmp_path_factory):
    from remote_drafter.testing import make_models
    return make_models(str(tmp_path_factory.mktemp("drafter-models")))


@pytest.fixture(scope="session")
def target(models):
    from remote_drafter.models.llama import LlamaLM
    return LlamaLM.load(models["target"])
