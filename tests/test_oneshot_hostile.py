"""The hostile-code suite through one-shot kernels: every case that applies, the same outcome.

Each case runs as one stateless run (the suite's prelude and the case's code in one request) on
a one-shot kernel of the suite's policy, network off or on, and must end exactly as it does in
the suite's ZMQ kernels (tests/test_hostile.py). Cases that are about the ZMQ transport itself
are listed in ZMQ_ONLY with the reason.
"""

from __future__ import annotations

import ast
import asyncio

import pytest

from sandbox_kernel.client import oneshot
from sandbox_kernel.launch.oneshot import OneShotPool
from sandbox_kernel.policy import SandboxPolicy
from tests.test_hostile import CASES, HOSTILE_POLICY, PRELUDE, _applies, world  # noqa: F401

# What the one-shot path answers differently, by design (none of these is a weaker outcome).
ZMQ_ONLY = {
}


@pytest.fixture(scope="module")
def pools(world):  # noqa: F811
    return {"hostile": OneShotPool(SandboxPolicy(**HOSTILE_POLICY), size=2),
            "net": OneShotPool(SandboxPolicy(allow_network=True, **HOSTILE_POLICY), size=2)}


def _outcome(pool, code):
    execution = asyncio.run(oneshot.run(pool, PRELUDE + "\n" + code, None, 30.0))
    assert execution.error is None, execution.error
    assert execution.text is not None, f"no result from {code!r}: {execution}"
    return ast.literal_eval(execution.text)


@pytest.mark.parametrize("case", [c for c in CASES if _applies(c) and c.id not in ZMQ_ONLY],
                         ids=lambda c: c.id)
def test_attack_on_a_one_shot_kernel(pools, world, case):  # noqa: F811
    code = case.code
    for name, value in world.items():
        code = code.replace("{" + name + "}", str(value))
    outcome = _outcome(pools[case.kernel], code)
    if isinstance(case.expect, tuple) and isinstance(outcome, list):
        outcome = tuple(outcome)
    assert outcome == case.expect, f"{case.id} {case.attack}: {outcome!r}"
