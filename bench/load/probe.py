"""`python -m bench.load.probe URL OUT`: GET URL/health every 50 ms until SIGTERM, one latency
(or the failure) per line in OUT.

A process of its own: in the harness's event loop (or a thread, under its GIL) the probe would
measure the harness too, which parses multi-megabyte answers.
"""

from __future__ import annotations

import signal
import sys
import time

import httpx

INTERVAL = 0.05


def main(url: str, out: str) -> int:
    running = True

    def stop(*_: object) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http, \
            open(out, "w", buffering=1) as lines:
        while running:
            started = time.monotonic()
            try:
                status = http.get("/health").status_code
                failure = "" if status == 200 else f"status {status}"
            except httpx.HTTPError as exc:
                failure = type(exc).__name__
            lines.write(f"{time.monotonic() - started:.6f} {failure}\n")
            time.sleep(max(0.0, INTERVAL - (time.monotonic() - started)))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
