"""The tools .ci/run installs: Docker and Compose, Debian's chromium, haproxy and python3-venv, and
Enterprise Gateway's venv.

A test that needs one skips where it is missing, saying why; in CI (CI=true) .ci/run has
installed them all, so there a missing one fails the test instead of skipping it unseen.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def unavailable(reason: str) -> NoReturn:
    """Skip the test for this reason, or fail it in CI."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (in CI, where .ci/run installs it)", pytrace=False)
    pytest.skip(reason)


def unmeasured(reason: str) -> NoReturn:
    """Skip a test whose goal could not be measured on this machine, or fail it in CI, where a
    goal no one measured would pass unseen."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"not measured: {reason} (in CI, every goal must be measured)", pytrace=False)
    pytest.skip(reason)
