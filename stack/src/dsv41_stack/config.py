"""An env file (or several: later ones override, e.g. production-D.env then the async
delta) read into the launcher's configuration. Lines are KEY=VALUE, `#` comments (a line's,
or after whitespace), optional quotes. A value must be of the kind its variable declares (a
number, 0 or 1, HOST:PORT, one of its words), and one still holding a template placeholder
`<...>` is an error; each error names the file and line, so nothing starts half-configured."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ofl import env as ofl_env
from ofl.env import EnvVar

from .settings import BY_NAME, COMPONENT_PREFIXES, UNCHECKED_PREFIXES, declared

PLACEHOLDER = re.compile(r"<[^<>]+>")
LINE = re.compile(r"^(?:export\s+)?([A-Z][A-Z0-9_]*)=(.*)$")


class ConfigError(ValueError):
    """An env file the launcher cannot use; the message says where and why."""


def parse(text: str, where: str = "env file") -> dict[str, str]:
    values, known = {}, declared()  # once a file: it imports and walks every component's list
    not_installed = unchecked(known)
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        if not match:
            raise ConfigError(f"{where}:{number}: not KEY=VALUE: {raw!r}")
        key, value = match.groups()
        value = without_comment(value)
        if PLACEHOLDER.search(value):
            raise ConfigError(f"{where}:{number}: {key} still holds the placeholder "
                              f"{PLACEHOLDER.search(value).group()}: replace it with this "
                              "deployment's value")
        try:
            words = shlex.split(value)
        except ValueError as exc:  # an unclosed quote
            raise ConfigError(f"{where}:{number}: {key}: {exc}") from None
        if len(words) > 1:
            raise ConfigError(f"{where}:{number}: {key} has spaces; quote the value")
        value = words[0] if words else ""
        if not key.startswith("STACK_") and not key.startswith(COMPONENT_PREFIXES):
            raise ConfigError(f"{where}:{number}: {key} is neither a STACK_ setting nor a "
                              f"component variable ({', '.join(COMPONENT_PREFIXES)}*)")
        if key.startswith("STACK_") and key not in BY_NAME:
            raise ConfigError(f"{where}:{number}: unknown setting {key} (dsv41-stack env lists them)")
        if key not in known and not key.startswith(not_installed):
            raise ConfigError(f"{where}:{number}: {key} is not a variable its component declares "
                              "(misspelled? dsv41-stack env lists them)")
        if key in known and (why := known[key].problem(value)):
            raise ConfigError(f"{where}:{number}: {why}")
        if key == ofl_env.OFL_INSECURE.name and value != "0":
            raise ConfigError(f"{where}:{number}: {key}: the stack's servers never run open to "
                              "every peer: set STACK_ENGINE_HOSTS and OFL_AUTH_KEY_FILE (preflight "
                              "says what is missing), or listen on loopback")
        values[key] = value
    return values


def unchecked(known: dict) -> tuple[str, ...]:
    """UNCHECKED_PREFIXES whose component is not installed here (none of its names known)."""
    return tuple(p for p in UNCHECKED_PREFIXES if not any(n.startswith(p) for n in known))


def without_comment(value: str) -> str:
    """The value before its comment: a `#` after whitespace and outside quotes, as a shell
    reads it (`#` inside a word, as in a key or a path, is the value's own)."""
    for match in re.finditer(r"\s#", value):
        head = value[:match.start()]
        try:
            shlex.split(head)
        except ValueError:  # the `#` is inside quotes
            continue
        return head
    return value


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
