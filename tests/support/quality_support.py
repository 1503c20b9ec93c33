"""What the tests of the quality benchmark (benchmarks/quality.py) share: the repository, the
script, its sibling modules imported as the script imports them, and the script run as a command."""
import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "quality.py"


def benchmarks_module(name: str):
    """benchmarks/NAME.py, imported as quality.py imports its sibling (benchmarks/ on sys.path)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module(name)


def quality(*args, check=True):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, check=check)
