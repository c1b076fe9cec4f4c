"""`python -m bench.container_imports [IMAGE]`: the shipped image, a pandas node against a bare one.

The service image (built as tests/test_container.py builds it) is run with compose.yaml's
settings, as that test runs it; once /ready says 200, a node importing nothing and a node
importing pandas are sent through the dify route (as Dify sends them: network on) for 10 s each
to warm their pools, then 15 of each, interleaved; the p50 of each and their ratio (#49: the
pandas node within 1.5x of the bare one) are printed and appended to
bench/results/service-imports.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.service import EXPECTED_STDOUT, dify_wrapped
from tests import test_container

NODES = {"nothing": 'def main() -> dict:\n    return {"a": 1}\n',
         "pandas": 'def main() -> dict:\n    import pandas as pd\n'
                   '    return {"a": len([pd.DataFrame])}\n'}
RESULTS = Path(__file__).parent / "results" / "service-imports.md"


def main() -> None:
    image = sys.argv[1] if len(sys.argv) > 1 else test_container.IMAGE
    test_container.IMAGE = image  # Container runs this tag
    port = test_container._free_port()
    container = test_container.Container(
        test_container.run_options(test_container._compose_service(), port), port)
    try:
        assert container.wait_answering(180)[-1][0] == 200, container.logs()
        client = httpx.Client(timeout=60)

        def once(node: str) -> tuple[float, bool]:
            started = time.perf_counter()
            answer = client.post(container.url + "/v1/sandbox/run",
                                 headers={"X-Api-Key": "dify-sandbox"},
                                 json={"language": "python3", "preload": "",
                                       "code": dify_wrapped(NODES[node], {}),
                                       "enable_network": True})
            return time.perf_counter() - started, \
                answer.json()["data"]["stdout"] == EXPECTED_STDOUT
        for node in NODES:
            end = time.monotonic() + 10
            while time.monotonic() < end:
                once(node)
        latencies: dict[str, list[float]] = {node: [] for node in NODES}
        failures = 0
        for _ in range(15):
            for node in NODES:
                elapsed, good = once(node)
                latencies[node].append(elapsed)
                failures += not good
    finally:
        container.remove()
    p50 = {node: statistics.median(values) * 1000 for node, values in latencies.items()}
    line = (f"- The shipped image ({image}, compose.yaml's settings; `python -m "
            f"bench.container_imports`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"load average {os.getloadavg()[0]:.1f}): p50 of 15, a bare node "
            f"{p50['nothing']:.1f} ms, a pandas node {p50['pandas']:.1f} ms: "
            f"{p50['pandas'] / p50['nothing']:.2f}x (target ≤ 1.5x); {failures} failed\n")
    print(line, end="")
    with RESULTS.open("a") as results:
        results.write("\n" + line)


if __name__ == "__main__":
    main()
