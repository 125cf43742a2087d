"""The stack restates none of its components' variables: each one it knows is the component's
own declaration (the same EnvVar, its default), a variable a component adds is known to the
stack as declared there, and the roles follow the components' defaults and helpers."""

import pytest

from async_handoff import env as handoff_env
from async_handoff.env import async_enabled
from dsv41_stack.cli import main
from dsv41_stack.config import StackConfig, parse
from dsv41_stack.deployment import Deployment
from dsv41_stack.roles import drafter_worker, engine, engram_server
from dsv41_stack.settings import COMPONENT_ENVS, declared
from ofl.env import EnvVar
from remote_drafter import env as drafter_env
from remote_engram import env as engram_env

COMPONENT_VARIABLES = [v for module in COMPONENT_ENVS for v in module.ALL]


@pytest.mark.parametrize("var", COMPONENT_VARIABLES, ids=lambda v: v.name)
def test_each_component_variable_is_the_components_declaration(var):
    assert declared()[var.name] is var
    assert StackConfig({})[var.name] == var.default  # left out of the env files
    assert StackConfig({var.name: "set"})[var] == "set"


def a_value(v: EnvVar) -> str:
    """A value of v's kind, told apart from the other variables' where the kind allows."""
    named = f"value-of-{v.name}"
    if v.problem(named) is None:
        return named
    if v.choices:
        return v.choices[-1]
    return {"int": "7", "number": "7.5", "flag": "0", "address": f"host-of-{v.name}:7"}[v.kind]


def test_every_component_variable_is_read_and_reaches_the_engine():
    text = "".join(f"{v.name}={a_value(v)}\n" for v in COMPONENT_VARIABLES)
    env = engine(StackConfig(parse(text))).env
    assert {v.name: env.get(v.name) for v in COMPONENT_VARIABLES} == \
        {v.name: a_value(v) for v in COMPONENT_VARIABLES}


def test_a_variable_a_component_adds_is_known_without_restating_it(monkeypatch, capsys):
    knob = EnvVar("ENGRAM_FUTURE_KNOB", "7", "A variable remote_engram might add.")
    monkeypatch.setattr(engram_env, "ALL", [*engram_env.ALL, knob])
    assert StackConfig({})["ENGRAM_FUTURE_KNOB"] == "7"
    assert main(["env"]) == 0
    assert "\n# remote_engram.env\n" in (out := capsys.readouterr().out)
    assert "ENGRAM_FUTURE_KNOB=7\n    A variable remote_engram might add.\n" in out
    assert engine(StackConfig(parse("ENGRAM_FUTURE_KNOB=8\n"))).env["ENGRAM_FUTURE_KNOB"] == "8"


def backend(role) -> str:
    return role.command[role.command.index("--backend") + 1]


def test_the_offload_host_takes_the_components_backends(monkeypatch):
    """Left out of the env files, each link's backend is the one its component declares: a
    changed declaration changes the command lines (a copy in the stack would not)."""
    cfg = StackConfig({"STACK_ENGRAM_LISTEN": "127.0.0.1:7480", "STACK_DRAFTER": "ngram",
                       "STACK_DRAFTER_LISTEN": "127.0.0.1:7490"})
    assert backend(engram_server(cfg)) == engram_env.ENGRAM_BACKEND.default
    assert backend(drafter_worker(cfg)) == drafter_env.REMOTE_DRAFTER_BACKEND.default
    monkeypatch.setattr(engram_env, "ENGRAM_BACKEND", EnvVar("ENGRAM_BACKEND", "shm", "changed"))
    monkeypatch.setattr(drafter_env, "REMOTE_DRAFTER_BACKEND",
                        EnvVar("REMOTE_DRAFTER_BACKEND", "verbs", "changed"))
    assert (backend(engram_server(cfg)), backend(drafter_worker(cfg))) == ("shm", "verbs")


@pytest.mark.parametrize("value", [None, "", "0", "1"])  # another value: refused as the file is read
def test_the_async_handoff_is_on_exactly_when_async_handoff_says(value):
    values = {drafter_env.REMOTE_DRAFTER_ADDRESS.name: "10.0.0.3:7490"}
    if value is not None:
        values[handoff_env.VLLM_DSPARK_REMOTE_ASYNC.name] = value
    assert Deployment(StackConfig(values)).async_on() is async_enabled(values)


def test_the_async_switchs_default_is_async_handoffs(monkeypatch):
    values = {drafter_env.REMOTE_DRAFTER_ADDRESS.name: "10.0.0.3:7490"}
    assert not Deployment(StackConfig(values)).async_on()
    monkeypatch.setattr(handoff_env, "VLLM_DSPARK_REMOTE_ASYNC",
                        EnvVar("VLLM_DSPARK_REMOTE_ASYNC", "1", "on unless unset"))
    assert Deployment(StackConfig(values)).async_on()
