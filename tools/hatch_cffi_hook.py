"""Hatchling build hook shared by our packages: compile cffi (API mode) helpers into the wheel.

Each package links this file as its `hatch_build.py` and lists its builders in pyproject:

    [tool.hatch.build.hooks.custom]
    builders = [{ path = "src/pkg/_x_build.py" }, { path = "src/pkg/_y_build.py", require-env = "PKG_BUILD_Y" }]

A builder module exposes `builder() -> cffi.FFI`; the compiled extension lands next to it
(editable installs import from src/) or inside the wheel. A builder that fails is skipped
with a message, unless its `require-env` variable is set to "require".
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class CffiHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        for entry in self.config.get("builders", []):
            path = Path(self.root) / entry["path"]
            required = os.environ.get(entry.get("require-env", ""), "") == "require"
            so = self._compile(path, required)
            if so is None:
                continue
            package_dir = path.parent
            if version == "editable":
                # beside the source, replaced in one step: a process that has the old
                # build loaded (another venv's tests of the same checkout) keeps its copy
                staged = package_dir / f".{so.name}.{os.getpid()}"
                shutil.copy2(so, staged)
                os.replace(staged, package_dir / so.name)
            else:
                rel = package_dir.relative_to(Path(self.root) / "src")
                build_data["force_include"][str(so)] = f"{rel.as_posix()}/{so.name}"
            build_data["pure_python"] = False
            build_data["infer_tag"] = True

    @staticmethod
    def _compile(path: Path, required: bool) -> Path | None:
        try:
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            out = module.builder().compile(tmpdir=tempfile.mkdtemp(prefix="cffi-"), verbose=False)
            return Path(out)
        except Exception as exc:  # noqa: BLE001 - any compiler/header failure lands here
            if required:
                raise RuntimeError(f"cannot build {path.name}: {exc}") from exc
            print(f"{path.name}: C helper not built ({exc}); install a C compiler and the "
                  "headers it needs, then reinstall", file=sys.stderr)
            return None
