"""HandoffConfig and env.py are one source: a config built in code has the defaults env.py
declares, and every variable env.py declares for the handoff reaches HandoffConfig.from_env()."""

import pytest

from async_handoff import HandoffConfig, async_enabled, env

# the switch (async_enabled reads it); every other variable configures the Handoff
HANDOFF_VARIABLES = [v for v in env.ALL if v is not env.VLLM_DSPARK_REMOTE_ASYNC]


@pytest.fixture
def unset(monkeypatch):
    """An environment with none of env.py's variables set: from_env() sees the defaults."""
    for var in env.ALL:
        monkeypatch.delenv(var.name, raising=False)
    return monkeypatch


def test_the_code_defaults_are_env_pys_declared_defaults(unset):
    assert HandoffConfig() == HandoffConfig.from_env()


def test_each_declared_variable_sets_a_field_of_its_own(unset):
    """A variable env.py adds (or one HandoffConfig stops reading) fails here."""
    field_of = {}
    for var in HANDOFF_VARIABLES:
        unset.setenv(var.name, str(int(var.default) + 1) if var.default.isdigit() else "other")
        config, default = vars(HandoffConfig.from_env()), vars(HandoffConfig())
        unset.delenv(var.name)
        changed = [k for k in config if config[k] != default[k]]
        assert len(changed) == 1, f"{var.name} sets {changed or 'no field'} of HandoffConfig"
        field_of[var.name] = changed[0]
    assert len(set(field_of.values())) == len(HANDOFF_VARIABLES), field_of


@pytest.mark.parametrize("value, enabled", [(None, False), ("", False), ("0", False),
                                            ("1", True), ("yes", None), ("false", None)])
def test_async_enabled_reads_the_environment_or_given_values_alike(unset, value, enabled):
    """1 turns it on, empty or 0 leaves it off; any other word is refused (was "false" off?)."""
    name = env.VLLM_DSPARK_REMOTE_ASYNC.name
    values = {} if value is None else {name: value}
    if value is not None:
        unset.setenv(name, value)
    if enabled is None:
        for read in (lambda: async_enabled(), lambda: async_enabled(values)):
            with pytest.raises(ValueError, match=f"{name}={value!r}: expected 0 or 1"):
                read()
        return
    assert async_enabled() is enabled
    assert async_enabled(values) is enabled
