"""An env file (or several: later ones override, e.g. production-D.env then the async
delta) read into the launcher's configuration. Lines are KEY=VALUE, `#` comments, optional
quotes; a value still holding a template placeholder `<...>` is an error that names the
line, so nothing starts half-configured."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ofl.env import EnvVar

from .settings import BY_NAME, COMPONENT_PREFIXES, UNCHECKED_PREFIXES, declared

PLACEHOLDER = re.compile(r"<[^<>]+>")
LINE = re.compile(r"^(?:export\s+)?([A-Z][A-Z0-9_]*)=(.*)$")


class ConfigError(ValueError):
    """An env file the launcher cannot use; the message says where and why."""


def parse(text: str, where: str = "env file") -> dict[str, str]:
    values = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        if not match:
            raise ConfigError(f"{where}:{number}: not KEY=VALUE: {raw!r}")
        key, value = match.groups()
        if PLACEHOLDER.search(value):
            raise ConfigError(f"{where}:{number}: {key} still holds the placeholder "
                              f"{PLACEHOLDER.search(value).group()}: replace it with this "
                              "deployment's value")
        words = shlex.split(value, comments=True)
        if len(words) > 1:
            raise ConfigError(f"{where}:{number}: {key} has spaces; quote the value")
        value = words[0] if words else ""
        if not key.startswith("STACK_") and not key.startswith(COMPONENT_PREFIXES):
            raise ConfigError(f"{where}:{number}: {key} is neither a STACK_ setting nor a "
                              f"component variable ({', '.join(COMPONENT_PREFIXES)}*)")
        if key.startswith("STACK_") and key not in BY_NAME:
            raise ConfigError(f"{where}:{number}: unknown setting {key} (dsv41-stack env lists them)")
        if key not in declared() and not key.startswith(UNCHECKED_PREFIXES):
            raise ConfigError(f"{where}:{number}: {key} is not a variable its component declares "
                              "(misspelled? dsv41-stack env lists them)")
        values[key] = value
    return values


class StackConfig:
    """The merged env files: STACK_* settings and component variables, each with its
    declared default."""

    def __init__(self, values: dict[str, str], sources: list[str] | None = None):
        self.values, self.sources = values, sources or []

    @classmethod
    def load(cls, paths: list[str | Path]) -> StackConfig:
        values: dict[str, str] = {}
        for path in paths:
            values.update(parse(Path(path).read_text(), str(path)))
        return cls(values, [str(p) for p in paths])

    def __getitem__(self, setting: str | EnvVar) -> str:
        """A setting's value in the env files, else its declared default: a STACK_ setting or
        a component's variable, by name or as the component declares it (its EnvVar)."""
        var = declared()[setting] if isinstance(setting, str) else setting
        return self.values.get(var.name, var.default)

    def int(self, setting: str | EnvVar) -> int:
        return int(self[setting])

    def components(self, *prefixes: str) -> dict[str, str]:
        """Component variables with these prefixes (all of them when none given)."""
        return {k: v for k, v in self.values.items()
                if not k.startswith("STACK_") and k.startswith(prefixes or COMPONENT_PREFIXES)}

    def with_values(self, **changes: str | None) -> StackConfig:
        """A copy with variables set, or removed where the value is None (rollbacks)."""
        values = {**self.values, **{k: v for k, v in changes.items() if v is not None}}
        for k in [k for k, v in changes.items() if v is None]:
            values.pop(k, None)
        return StackConfig(values, self.sources)

    @contextmanager
    def link_client(self) -> Iterator[None]:
        """This process's own ofl clients (status, preflight's qualify and identity checks,
        `up`'s check of the offload host) use the env files' OFL_ variables as the engines do,
        the key among them; the environment is restored after."""
        values = self.components("OFL_")
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
