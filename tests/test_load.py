"""Small, bounded versions of the load harness's scenarios 1, 3 and 4 (tests/load), against the
real `sandbox-kernel serve` on 127.0.0.1: a regression in correctness under concurrency, in
fault handling or in input validation fails here. The full-size runs and every figure stay in
`python -m bench.load`; nothing here is timed beyond the service's own deadlines."""

from __future__ import annotations

import asyncio
import collections

import pytest

from tests.ci_tools import unmeasured
from tests.load import check, faults, fuzz, mixed
from tests.load.results import Goal, ScenarioResult

pytestmark = pytest.mark.timeout(300)

# 8 concurrent runs, 52 in all: every hostile kind once in the mixed phase.
MIXED = mixed.Plan(normal_only=12, mixed=40, concurrency=8, worker_timeout=3.0, warmup=4)
FUZZ = fuzz.Plan(max_examples=5)


def goal(result: ScenarioResult, name: str) -> Goal:
    found = [g for g in result.goals if g.name.startswith(name)]
    assert found, f"no goal {name!r} in {[g.name for g in result.goals]}"
    return found[0]


def assert_met(found: Goal) -> None:
    if found.met is None:  # skipped here, failed in CI
        unmeasured(f"{found.name}: {found.evidence}")
    assert found.met, f"{found.name}: {found.value}\n{found.evidence}"


# --- 1. mixed load ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixed_run() -> ScenarioResult:
    return asyncio.run(mixed.run(MIXED, quick=True))


def hostile_verdicts(result: ScenarioResult) -> dict[str, collections.Counter[str]]:
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for _, _, phase, kind, hostile, verdict, _ in result.series["requests"]:
        if hostile and phase == "mixed":
            by_kind[kind][verdict] += 1
    return by_kind


def test_mixed_normal_runs_all_correct(mixed_run: ScenarioResult) -> None:
    assert_met(goal(mixed_run, "normal runs correct"))


@pytest.mark.parametrize("kind", mixed.workload.HOSTILE_CORE)
def test_mixed_hostile_run_answered_with_an_error(mixed_run: ScenarioResult, kind: str) -> None:
    verdicts = hostile_verdicts(mixed_run)[kind]
    assert verdicts and set(verdicts) == {check.ERROR_ENVELOPE}, verdicts


def test_mixed_service_back_to_baseline(mixed_run: ScenarioResult) -> None:
    assert_met(goal(mixed_run, "back to baseline"))


# --- 3. faults --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fault_run() -> ScenarioResult:
    return asyncio.run(faults.run(quick=True))


@pytest.mark.parametrize("name", [
    "kill -9 a kernel mid-run (dify route)",
    "kill -9 a kernel mid-run (native API)",
    "fill a kernel's scratch",
    "a client disconnects mid-run (dify route)",
    "a client disconnects mid-stream (native SSE)",
    "exhaust the pool",
    "kill -9 the fork server",
    "make the audit log unwritable",
])
def test_fault_handled(fault_run: ScenarioResult, name: str) -> None:
    assert_met(goal(fault_run, name))


def test_fault_sigterm_under_load(fault_run: ScenarioResult) -> None:
    assert_met(goal(fault_run, "SIGTERM to the service under load"))


# --- 4. bad input -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_run() -> ScenarioResult:
    return asyncio.run(fuzz.run(FUZZ, quick=True))


def test_fuzz_no_server_error(fuzz_run: ScenarioResult) -> None:
    assert_met(goal(fuzz_run, "zero 5xx"))


def test_fuzz_no_hang(fuzz_run: ScenarioResult) -> None:
    assert_met(goal(fuzz_run, "zero hangs"))


def test_fuzz_every_rejection_clear(fuzz_run: ScenarioResult) -> None:
    assert_met(goal(fuzz_run, "each rejection a clear 4xx"))


def test_fuzz_no_rejection_dropped(fuzz_run: ScenarioResult) -> None:
    assert_met(goal(fuzz_run, "no rejection dropped"))
