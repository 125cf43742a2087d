"""EnvVar: what each kind of variable takes, and errors that name the variable."""

import pytest

from ofl import env
from ofl.env import EnvVar


@pytest.mark.parametrize("var, good, bad", [
    (EnvVar("X_MS", "50", "", kind="number"), ["0", "2.5", ".5", "50"], ["-1", "fast", "", "1e3", "nan", "\u00b2"]),
    (EnvVar("X_N", "8", "", kind="int"), ["0", "64"], ["8.0", "-2", "eight", "", "\u00b2", "\u0663"]),
    (EnvVar("X_ON", "0", "", kind="flag"), ["0", "1"], ["true", "yes", "2", ""]),
    (EnvVar("X_AT", "", "", kind="address"), ["10.0.0.1:7480", "[::1]:80", "h:0", ""],
     ["localhost", ":80", "h:", "h:65536", "h:x", "h:\u00b9"]),
    (EnvVar("X_MODE", "auto", "", choices=("auto", "0", "1")), ["auto", "0", "1"], ["on", ""]),
    (EnvVar("X_CAP", "auto", "", kind="int", choices=("auto",)), ["auto", "12"], ["many"]),
    (EnvVar("X_TEXT", "", ""), ["anything at all", ""], []),
])
def test_values_of_each_kind(var, good, bad):
    assert [v for v in good if var.problem(v)] == []
    for value in bad:
        assert var.problem(value).startswith(f"X_{var.name[2:]}={value!r}: expected ")


def test_every_ofl_default_is_of_its_kind_and_reads_clearly(monkeypatch):
    assert [v.name for v in env.ALL if v.problem(v.default)] == []
    monkeypatch.setenv("OFL_DEADLINE_MS", "fast")
    with pytest.raises(ValueError, match="OFL_DEADLINE_MS='fast' is not a number"):
        env.OFL_DEADLINE_MS.get_float()
    monkeypatch.setenv("OFL_MAX_INFLIGHT", "8.5")
    with pytest.raises(ValueError, match="OFL_MAX_INFLIGHT='8.5' is not a whole number"):
        env.OFL_MAX_INFLIGHT.get_int()
