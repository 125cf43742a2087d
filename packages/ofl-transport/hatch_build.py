"""Build hook: compile ofl's C helpers (cffi, API mode) into the wheel.

* `ofl._gather_cffi` (plain C): the row-gather loop; without it ofl.gather uses numpy.
* `ofl._verbs_cffi` (libibverbs): the verbs data path; without libibverbs headers the wheel
  still builds (tcp and shm need no verbs) and the verbs backend says why it is unavailable.
  Set OFL_BUILD_VERBS=require to make a missing verbs helper a build error (CI does).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ROOT = Path(__file__).parent
PKG = ROOT / "src" / "ofl"
HELPERS = {"_gather_build": "auto", "_verbs_build": os.environ.get("OFL_BUILD_VERBS", "auto")}


class CHelperHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        sys.path.insert(0, str(PKG))
        try:
            for module, mode in HELPERS.items():
                so = self._compile(module, mode == "require")
                if so is None:
                    continue
                if version == "editable":
                    shutil.copy2(so, PKG / so.name)  # the editable install imports from src/
                else:
                    build_data["force_include"][str(so)] = f"ofl/{so.name}"
                build_data["pure_python"] = False
                build_data["infer_tag"] = True
        finally:
            sys.path.remove(str(PKG))

    @staticmethod
    def _compile(module: str, required: bool) -> Path | None:
        try:
            builder = __import__(module).builder
            return Path(builder().compile(tmpdir=tempfile.mkdtemp(prefix="ofl-cffi-"),
                                          verbose=False))
        except Exception as exc:  # noqa: BLE001 - any compiler/header failure lands here
            if required:
                raise RuntimeError(f"ofl: cannot build {module}: {exc}") from exc
            print(f"ofl: {module} helper not built ({exc}); install a C compiler (and "
                  "libibverbs-dev for verbs), then reinstall", file=sys.stderr)
            return None
