"""The project's own checks run with the suite: ruff's rules and mypy's types (pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check(*command: str) -> None:
    done = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{' '.join(command)} found problems:\n{done.stdout}{done.stderr}"


def test_ruff_is_clean() -> None:
    _check("ruff", "check", ".")


def test_mypy_is_clean() -> None:
    _check("mypy", "sandbox_kernel")
