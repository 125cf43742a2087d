"""Build hook: compile the verbs data-path helper (cffi, API mode) into the wheel.

Without libibverbs headers the wheel still builds (tcp and shm need no C), and the verbs
backend later says why it is unavailable. Set OFL_BUILD_VERBS=require to make a missing
helper a build error instead (CI does).
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


class VerbsHelperHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        required = os.environ.get("OFL_BUILD_VERBS", "auto") == "require"
        sys.path.insert(0, str(PKG))
        try:
            from _verbs_build import builder

            tmp = tempfile.mkdtemp(prefix="ofl-cffi-")
            so = Path(builder().compile(tmpdir=tmp, verbose=False))
        except Exception as exc:  # noqa: BLE001 - any compiler/header failure lands here
            if required:
                raise RuntimeError(f"ofl: cannot build the verbs helper: {exc}") from exc
            print(f"ofl: verbs helper not built ({exc}); install libibverbs-dev and a C "
                  "compiler, then reinstall, to use the verbs backend", file=sys.stderr)
            return
        finally:
            sys.path.remove(str(PKG))
        if version == "editable":
            # The editable install imports from src/: put the extension there.
            shutil.copy2(so, PKG / so.name)
        else:
            build_data["force_include"][str(so)] = f"ofl/{so.name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
