"""EG's own receiving side, run with Enterprise Gateway's interpreter (not ours) by the tests.

Prints one JSON line with a fresh kernel id, EG's public key and response address; then waits
for a launcher's payload through `ResponseManager` and prints the decrypted connection info as
a second line (or {"error": ...} after the deadline).
"""

import asyncio
import json
import sys
import time
import uuid

from enterprise_gateway.services.processproxies.processproxy import ResponseManager


async def receive(deadline: float) -> None:
    manager = ResponseManager.instance()
    kernel_id = str(uuid.uuid4())
    manager.register_event(kernel_id)
    print(json.dumps({"kernel_id": kernel_id, "public_key": manager.public_key,
                      "response_address": manager.response_address}), flush=True)
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            info = await manager.get_connection_info(kernel_id)
        except asyncio.TimeoutError:
            continue
        print(json.dumps(info), flush=True)
        return
    print(json.dumps({"error": f"no payload within {deadline} s"}), flush=True)


if __name__ == "__main__":
    asyncio.run(receive(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0))
