"""`python -m bench.clients`: a fresh kernel through the clients the Jupyter ecosystem uses.

Each row starts a fresh kernel the way that client does, with that client's own settings (no
faster reconnect, no package code on the client's side), and stops the clock at its first
answer; plain ipykernel goes through the very same client, and the kinds alternate:

- `stock.*`: jupyter_client's `KernelManager.start_kernel()`, then a `BlockingKernelClient`'s
  `kernel_info()` until its reply (what jupyter_server, nbclient and papermill build on);
  `stock_async.*` the same with `AsyncKernelManager` and `AsyncKernelClient`.
- `package.fork`: this package's own manager (`Sandbox(None)` start-to-ready).
- `nbclient.*`: nbclient's `NotebookClient` executing a one-cell notebook (`1 + 1`), from
  creating the client to the executed notebook, kernel start and shutdown included.
- `gateway.*`: Jupyter Kernel Gateway (started once by the bench on 127.0.0.1): from
  `POST /api/kernels` to the first `kernel_info_reply` on the kernel's websocket.

Kinds: `plain` is `python -m ipykernel_launcher`; `fork` is the kernelspec this package installs
(`python -I -m sandbox_kernel`, default policy) with its fork-server provisioner, the server
already running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.request import Request, urlopen

from bench.stats import publish
from tests.load.service import free_port

PLAIN, FORK = "plain", "fork"
RESULTS = Path(__file__).parent / "results" / "clients.md"
TIMEOUT = 60.0


def write_kernelspecs(data_dir: Path) -> None:
    """bench-plain and bench-fork, in a Jupyter data dir of the bench's own."""
    from sandbox_kernel.install import kernel_json
    from sandbox_kernel.policy import SandboxPolicy

    specs = {PLAIN: {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                              "{connection_file}"],
                     "display_name": "plain", "language": "python"},
             FORK: kernel_json(SandboxPolicy(), "fork")}
    for kind, spec in specs.items():
        folder = data_dir / "kernels" / f"bench-{kind}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel.json").write_text(json.dumps(spec))


def stock(kind: str) -> float:
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name=f"bench-{kind}")
    started = time.perf_counter()
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        client.kernel_info(reply=True, timeout=TIMEOUT)
        return time.perf_counter() - started
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def stock_async(kind: str) -> float:
    from jupyter_client.manager import AsyncKernelManager

    async def once() -> float:
        manager = AsyncKernelManager(kernel_name=f"bench-{kind}")
        started = time.perf_counter()
        await manager.start_kernel()
        client = manager.client()
        client.start_channels()
        try:
            await client.kernel_info(reply=True, timeout=TIMEOUT)
            return time.perf_counter() - started
        finally:
            client.stop_channels()
            await manager.shutdown_kernel(now=True)
    return asyncio.run(once())


def package(kind: str) -> float:
    from sandbox_kernel.client import Sandbox

    sandbox = Sandbox(f"bench-{kind}")
    started = time.perf_counter()
    sandbox.start()
    elapsed = time.perf_counter() - started
    sandbox.close(now=True)
    return elapsed


def notebook(kind: str) -> float:
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    started = time.perf_counter()
    NotebookClient(book, kernel_name=f"bench-{kind}", timeout=TIMEOUT).execute()
    elapsed = time.perf_counter() - started
    assert book.cells[0].outputs[0]["data"]["text/plain"] == "2", book.cells[0].outputs
    return elapsed


class Gateway:
    """A Kernel Gateway on 127.0.0.1 serving the bench's kernelspecs."""

    def __init__(self, data_dir: Path, log: Path) -> None:
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"127.0.0.1:{self.port}"
        env = {**os.environ, "JUPYTER_DATA_DIR": str(data_dir)}
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jupyter", "kernelgateway",
                 "--KernelGatewayApp.ip=127.0.0.1", f"--KernelGatewayApp.port={self.port}",
                 "--KernelGatewayApp.port_retries=0",
                 f"--KernelGatewayApp.auth_token={self.token}"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                with urlopen(f"http://{self.url}/api/kernelspecs?token={self.token}"):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"Kernel Gateway did not start; see {log}")

    def first_reply(self, kind: str) -> float:
        from websockets.sync.client import connect

        started = time.perf_counter()
        request = Request(f"http://{self.url}/api/kernels?token={self.token}", method="POST",
                          data=json.dumps({"name": f"bench-{kind}"}).encode(),
                          headers={"Content-Type": "application/json"})
        with urlopen(request) as response:  # noqa: S310 (http://127.0.0.1, built above)
            kernel = json.loads(response.read())["id"]
        try:
            with connect(f"ws://{self.url}/api/kernels/{kernel}/channels?token={self.token}",
                         open_timeout=TIMEOUT) as ws:
                msg_id = uuid.uuid4().hex
                ws.send(json.dumps({"header": {"msg_id": msg_id, "username": "bench",
                                               "session": uuid.uuid4().hex,
                                               "msg_type": "kernel_info_request",
                                               "version": "5.3"},
                                    "parent_header": {}, "metadata": {}, "content": {},
                                    "channel": "shell"}))
                while True:
                    message = json.loads(ws.recv(timeout=TIMEOUT))
                    if message.get("parent_header", {}).get("msg_id") == msg_id \
                            and message["msg_type"] == "kernel_info_reply":
                        return time.perf_counter() - started
        finally:
            with urlopen(Request(f"http://{self.url}/api/kernels/{kernel}?token={self.token}",
                                 method="DELETE")):
                pass

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def measure(rows: dict[str, Callable[[str], float]], kinds: dict[str, tuple[str, ...]],
            repeats: int) -> dict[str, list[float]]:
    """Each row's kinds alternate, row after row, round after round; one discarded warm-up."""
    times: dict[str, list[float]] = {f"{row}.{kind}": [] for row in rows for kind in kinds[row]}
    for round_number in range(repeats + 1):
        for row, run in rows.items():
            for kind in kinds[row]:
                elapsed = run(kind)
                if round_number:
                    times[f"{row}.{kind}"].append(elapsed)
    return times


def report(times: dict[str, list[float]], repeats: int, load: tuple[float, float]) -> str:
    lines = ["# Fresh kernels through the ecosystem's clients", "",
             f"Command: `python -m bench.clients {' '.join(sys.argv[1:])}`", "",
             f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} "
             f"CPUs; load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}",
             f"- {repeats} measured starts of each kind, kinds alternating (see the module "
             "docstring of bench/clients.py for what each row times)", "",
             "| Row | Median | p90 | n | fork / plain (median) | Target | Met |",
             "|---|---|---|---|---|---|---|"]
    for name, values in times.items():
        row, kind = name.rsplit(".", 1)
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 \
            else values[0]
        ratio = target = met = ""
        plain = times.get(f"{row}.{PLAIN}")
        if kind == FORK and plain:
            value = median / statistics.median(plain)
            ratio = f"{value:.3f}x"
            if row in ("stock", "stock_async"):
                target, met = "≤ 0.15x", "yes" if value <= 0.15 else "**NO**"
        if row == "package" and times.get(f"stock.{PLAIN}"):
            ratio = f"{median / statistics.median(times[f'stock.{PLAIN}']):.3f}x (of stock.plain)"
        lines.append(f"| `{name}` | {median * 1000:.1f} ms | {p90 * 1000:.1f} ms | {len(values)}"
                     f" | {ratio} | {target} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.clients", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-gateway", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    os.environ["JUPYTER_DATA_DIR"] = str(root / "data")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(root / "runtime")
    write_kernelspecs(root / "data")
    both = (PLAIN, FORK)
    rows: dict[str, Callable[[str], float]] = {"stock": stock, "stock_async": stock_async,
                                               "package": package, "nbclient": notebook}
    kinds = {"stock": both, "stock_async": both, "package": (FORK,), "nbclient": both,
             "gateway": both}
    gateway = None if args.no_gateway else Gateway(root / "data", root / "gateway.log")
    if gateway is not None:
        rows["gateway"] = gateway.first_reply
    load_before = os.getloadavg()[0]
    try:
        times = measure(rows, kinds, args.repeats)
    finally:
        if gateway is not None:
            gateway.stop()
        from sandbox_kernel.launch import forkserver

        forkserver.stop_servers()
    return publish(report(times, args.repeats, (load_before, os.getloadavg()[0])), args.out)


if __name__ == "__main__":
    sys.exit(main())
