"""The checkout's benchmark scripts (benchmarks/, no package) as modules, for the tests that run
their smoke forms or reuse their references."""

import importlib.util
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """benchmarks/<name>.py as a module."""
    sys.path.insert(0, str(FOLDER))  # the scripts import one another
    try:
        spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(FOLDER))
    return script
