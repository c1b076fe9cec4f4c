"""The requests a load run sends: Dify-style code nodes with known results, and hostile code.

A normal item is what Dify's code executor posts: the user's `main()`, then a runner that decodes
the inputs (base64 JSON), calls `output = main(**inputs)` and prints the JSON between
`<<RESULT>>` markers. Its expected result is computed here, by calling the same `main()` in this
process (the code nodes are ours and harmless), with inputs drawn from a seeded generator, so every
request has a distinct, known answer.

A hostile item attacks the service through its kernel: memory, CPU in C, threads, output,
crashes, processes, raw sockets. It has no right answer; the only correct reply is an error.
"""

from __future__ import annotations

import base64
import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RESULT_MARKER = "<<RESULT>>"

# Dify's Python runner (api/core/helper/code_executor/python3/python3_transformer.py), as sent.
RUNNER = """\
# declare main function
{code}

import json
from base64 import b64decode

# decode and prepare input dict
inputs_obj = json.loads(b64decode('{inputs}').decode('utf-8'))

# execute main function
output_obj = main(**inputs_obj)

# convert output to json and print
output_json = json.dumps(output_obj, indent=4)

result = f'''<<RESULT>>{{output_json}}<<RESULT>>'''
print(result)
"""


@dataclass
class Item:
    """One request of a load run."""

    index: int
    kind: str
    hostile: bool
    code: str  # the whole runner script, as posted
    expected: dict | None = None  # the result between the markers, for a normal item
    expected_stdout: str = ""  # what main() prints before the result, for a normal item
    enable_network: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        """The JSON body of `POST /v1/sandbox/run`."""
        return {"language": "python3", "code": self.code, "preload": "",
                "enable_network": self.enable_network}


def runner_script(code: str, inputs: dict[str, Any]) -> str:
    """The script Dify's code executor sends for this user code and these inputs."""
    encoded = base64.b64encode(json.dumps(inputs, ensure_ascii=False).encode()).decode()
    return RUNNER.format(code=code, inputs=encoded)


# ---------------------------------------------------------------------------------------------
# Normal code nodes: (user code, input generator). Each prints something, as real nodes log.

def _words(rng: random.Random, n: int) -> list[str]:
    alphabet = string.ascii_letters + "éßøλжダ雪"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(n)]


NORMAL: dict[str, tuple[str, Callable[[random.Random], dict[str, Any]]]] = {
    # Dify's default code-node template.
    "template": ('''
def main(arg1: str, arg2: str) -> dict:
    print("concatenating")
    return {
        "result": arg1 + arg2,
    }
''', lambda rng: {"arg1": " ".join(_words(rng, 3)), "arg2": " ".join(_words(rng, 2))}),
    "numbers": ('''
import statistics

def main(values: list, scale: float) -> dict:
    print(f"{len(values)} values")
    scaled = [v * scale for v in values]
    return {"sum": sum(scaled), "max": max(scaled), "mean": statistics.fmean(scaled),
            "count": len(scaled)}
''', lambda rng: {"values": [rng.randint(-10**6, 10**6) for _ in range(rng.randint(1, 50))],
                  "scale": rng.choice([1, 2, 0.5, -3])}),
    "records": ('''
def main(rows: list, key: str) -> dict:
    ordered = sorted(rows, key=lambda r: (r[key], r["id"]))
    groups = {}
    for row in ordered:
        groups.setdefault(str(row["group"]), []).append(row["id"])
    print("sorted", len(ordered), "rows")
    return {"first": ordered[0], "ids": [r["id"] for r in ordered], "groups": groups}
''', lambda rng: {"key": rng.choice(["score", "name"]), "rows": [
        {"id": i, "name": "".join(_words(rng, 1)), "score": rng.randint(0, 100),
         "group": rng.randint(0, 3)} for i in range(rng.randint(1, 30))]}),
    "text": ('''
import re
import unicodedata

def main(text: str) -> dict:
    words = re.findall(r"\\w+", text)
    print("words:", len(words))
    return {"upper": text.upper(), "words": len(words),
            "nfkd_len": len(unicodedata.normalize("NFKD", text)),
            "reversed": text[::-1]}
''', lambda rng: {"text": " ".join(_words(rng, rng.randint(1, 20)))}),
    "nested": ('''
import json

def main(config: dict, path: list) -> dict:
    node = config
    for step in path:
        node = node[step]
    print("found", json.dumps(node)[:40])
    return {"value": node, "keys": sorted(config), "depth": len(path)}
''', lambda rng: _nested(rng)),
    "dates": ('''
import datetime
import warnings

def main(start: str, days: int) -> dict:
    warnings.warn("a warning on stderr must not fail the run")
    day = datetime.date.fromisoformat(start)
    later = day + datetime.timedelta(days=days)
    print("from", day, "to", later)
    return {"end": later.isoformat(), "weekday": later.strftime("%A"),
            "iso_week": later.isocalendar()[1]}
''', lambda rng: {"start": f"20{rng.randint(10, 30)}-{rng.randint(1, 12):02d}-"
                           f"{rng.randint(1, 28):02d}", "days": rng.randint(-400, 400)}),
    "hashing": ('''
import hashlib

def main(items: list) -> dict:
    digests = {item: hashlib.sha256(item.encode()).hexdigest()[:16] for item in items}
    print("hashed", len(digests))
    return {"digests": digests, "total": len("".join(items))}
''', lambda rng: {"items": _words(rng, rng.randint(1, 10))}),
    "numpy": ('''
import numpy as np

def main(matrix: list) -> dict:
    a = np.array(matrix, dtype=np.int64)
    print("shape", a.shape)
    return {"trace": int(np.trace(a)), "column_sums": a.sum(axis=0).tolist(),
            "transpose": a.T.tolist()}
''', lambda rng: {"matrix": [[rng.randint(-99, 99) for _ in range(4)] for _ in range(4)]}),
}


def _nested(rng: random.Random) -> dict[str, Any]:
    leaf: Any = {"leaf": _words(rng, 2), "n": rng.randint(0, 10**9)}
    path: list[Any] = []
    config: Any = leaf
    for depth in range(rng.randint(1, 5)):
        key = f"k{depth}_{rng.randint(0, 99)}"
        config = {key: config, f"other{depth}": rng.random()}
        path.insert(0, key)
    return {"config": config, "path": path}


def _expected(code: str, inputs: dict[str, Any]) -> tuple[dict, str]:
    """What main() returns and prints, run here with plain CPython."""
    import contextlib
    import io
    import warnings

    namespace: dict[str, Any] = {}
    exec(compile(code, "<code node>", "exec"), namespace)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = namespace["main"](**json.loads(json.dumps(inputs)))
    # The runner prints json.dumps(result): compare with what JSON makes of it.
    return json.loads(json.dumps(result)), printed.getvalue()


# ---------------------------------------------------------------------------------------------
# Hostile code. Each is wrapped in main() so it runs the way a code node would.

HOSTILE: dict[str, str] = {
    # Grows until the memory limit. bytes(n) is calloc'd, so the pages are reserved (and
    # counted by RLIMIT_DATA) but never touched: the host's RAM is not actually used.
    "memory_bomb": '''
def main() -> dict:
    hoard = []
    while True:
        hoard.append(bytes(256 * 2**20))
''',
    # A loop inside C: no bytecode boundary, so neither SIGALRM nor SIGINT can stop it.
    "c_loop": '''
def main() -> dict:
    return {"never": sum(range(10**15))}
''',
    "regex_loop": '''
import re

def main() -> dict:
    return {"never": bool(re.match(r"(a+)+$", "a" * 64 + "b"))}
''',
    "thread_bomb": '''
import threading
import time

def main() -> dict:
    threads = []
    while True:
        t = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
        t.start()
        threads.append(t)
''',
    "output_flood": '''
import sys

def main() -> dict:
    line = "A" * 65535 + "\\n"
    while True:
        sys.stdout.write(line)
''',
    "segfault": '''
import ctypes

def main() -> dict:
    ctypes.string_at(0)
    return {"survived": True}
''',
    "os_exit": '''
import os

def main() -> dict:
    os._exit(0)
''',
    "fork": '''
import os

def main() -> dict:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return {"forked": pid}
''',
    "raw_socket": '''
import socket

def main() -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    return {"raw": s.fileno()}
''',
}
HOSTILE_CORE = ("memory_bomb", "c_loop", "thread_bomb", "output_flood", "segfault", "os_exit",
                "fork", "raw_socket")  # the eight kinds the issue names


def normal_item(index: int, kind: str, rng: random.Random) -> Item:
    """A code node of this kind with fresh inputs and its expected result."""
    code, make_inputs = NORMAL[kind]
    inputs = make_inputs(rng)
    expected, printed = _expected(code, inputs)
    return Item(index, kind, False, runner_script(code, inputs), expected, printed,
                enable_network=rng.random() < 0.75)


def hostile_item(index: int, kind: str, rng: random.Random) -> Item:
    """A hostile code node of this kind."""
    return Item(index, kind, True, runner_script(HOSTILE[kind], {}),
                enable_network=rng.random() < 0.75)


def mix(count: int, hostile_share: float, seed: int = 14,
        hostile_kinds: tuple[str, ...] = HOSTILE_CORE,
        normal_kinds: tuple[str, ...] = tuple(NORMAL)) -> list[Item]:
    """count items, hostile_share of them hostile (kinds in turn), shuffled with a fixed seed."""
    rng = random.Random(seed)
    hostile_count = round(count * hostile_share)
    kinds = [(True, hostile_kinds[i % len(hostile_kinds)]) for i in range(hostile_count)]
    kinds += [(False, normal_kinds[i % len(normal_kinds)]) for i in range(count - hostile_count)]
    rng.shuffle(kinds)
    return [hostile_item(i, kind, rng) if hostile else normal_item(i, kind, rng)
            for i, (hostile, kind) in enumerate(kinds)]


SLEEPER = '''
import time

def main(seconds: float, tag: str) -> dict:
    open(tag, "w").close()  # lets the harness find this run's kernel (its cwd is the scratch)
    time.sleep(seconds)
    return {"tag": tag, "slept": seconds}
'''


def sleeper_item(index: int, seconds: float, tag: str, network: bool = False) -> Item:
    """A node that marks its scratch with tag, sleeps, then returns {"tag", "slept"}."""
    return Item(index, "sleeper", False, runner_script(SLEEPER, {"seconds": seconds, "tag": tag}),
                {"tag": tag, "slept": seconds}, "", enable_network=network)


def code_item(index: int, kind: str, code: str, hostile: bool = True,
              network: bool = False) -> Item:
    """An item with user code of the caller's own, run through the runner with no inputs."""
    return Item(index, kind, hostile, runner_script(code, {}), enable_network=network)
