"""`main()` calls: through a warm Sandbox, through a fresh process per call, and concurrently."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_kernel.client import Sandbox

# The same code goes to the kernel and to the process-per-request child.
SMALL_CODE = "def main(x):\n    return {'y': x * 2}\n"
SMALL_INPUTS = {"x": 21}
SMALL_RESULT = {"y": 42}
ECHO_CODE = "def main(rows):\n    return {'rows': rows}\n"
CHILD = Path(__file__).with_name("_child.py")
CALL_TIMEOUT = 120.0


@dataclass(frozen=True)
class Call:
    """One main() call: its code, inputs, and the result it must return."""

    code: str
    inputs: dict[str, Any]
    expected: dict[str, Any]

    def json_bytes(self, returned: bool = True) -> int:
        """Bytes of JSON moved: the inputs in, plus the result out when one came back."""
        out = len(json.dumps(self.expected)) if returned else 0
        return len(json.dumps(self.inputs)) + out


SMALL_CALL = Call(SMALL_CODE, SMALL_INPUTS, SMALL_RESULT)


def echo_call(size: int) -> Call:
    """A call whose inputs and result are each about `size` bytes of JSON records."""
    record = {"id": 0, "name": "item-00000000", "value": 0.25, "tags": ["alpha", "beta"]}
    count = max(1, size // len(json.dumps(record)))
    rows = [{**record, "id": i, "name": f"item-{i:08d}", "value": i / 4} for i in range(count)]
    return Call(ECHO_CODE, {"rows": rows}, {"rows": rows})


class ContractMissing(Exception):
    """The kernel ran the code but returned no main() result (the convention is not in yet)."""


def call_in_sandbox(sandbox: Sandbox, call: Call, verify: bool = True) -> float:
    """One main() call on a warm sandbox; return its wall-clock seconds.

    With verify, a missing result raises ContractMissing; without, it is tolerated (for a
    kernel that does not implement the convention yet) but a wrong result never is.
    """
    started = time.perf_counter()
    execution = sandbox.run(call.code, inputs=call.inputs, timeout=CALL_TIMEOUT)
    elapsed = time.perf_counter() - started
    if execution.error is not None:
        raise RuntimeError(f"main() failed in the sandbox: {execution.error}")
    if execution.result is None:
        if verify:
            raise ContractMissing("the kernel returned no execute_result for main()")
        return elapsed
    if execution.result != call.expected:
        raise RuntimeError("main() returned a different result in the sandbox")
    return elapsed


def kernel_returns_results(sandbox: Sandbox) -> bool:
    """Whether this kernel implements the main() convention (returns the dict)."""
    try:
        call_in_sandbox(sandbox, SMALL_CALL)
    except ContractMissing:
        return False
    return True


def call_in_fresh_process(call: Call) -> float:
    """One main() call the old way: a new filtered python per request; return its seconds."""
    request = json.dumps({"code": call.code, "inputs": call.inputs}).encode()
    started = time.perf_counter()
    # -I as in the kernelspec: neither side pays for the user's site-packages or environment.
    done = subprocess.run([sys.executable, "-I", str(CHILD)], input=request,
                          capture_output=True, timeout=CALL_TIMEOUT, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the per-request child failed: {done.stderr.decode()[-2000:]}")
    if json.loads(done.stdout) != call.expected:
        raise RuntimeError("the per-request child returned a different result")
    return elapsed


def calls_per_second(sandboxes: list[Sandbox], calls_each: int, verify: bool) -> float:
    """Drive every sandbox from its own thread at once; return completed calls per second."""
    start_line = threading.Barrier(len(sandboxes) + 1)
    failures: list[BaseException] = []

    def drive(sandbox: Sandbox) -> None:
        start_line.wait()
        try:
            for _ in range(calls_each):
                call_in_sandbox(sandbox, SMALL_CALL, verify)
        except BaseException as exc:  # re-raised in the caller's thread below
            failures.append(exc)

    threads = [threading.Thread(target=drive, args=(sb,), daemon=True) for sb in sandboxes]
    for thread in threads:
        thread.start()
    start_line.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise failures[0]
    return len(sandboxes) * calls_each / elapsed
