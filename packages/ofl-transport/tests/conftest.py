import pytest

from ofl.testing import ServeProcess


@pytest.fixture(params=["tcp", "shm"])
def served(request):
    srv = ServeProcess(request.param)
    yield srv
    srv.stop()
