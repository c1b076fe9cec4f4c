"""Snippets and assertions shared by the tests."""

# Defines raw(nr, *args) -> (return value, errno) inside a kernel: the syscall as the attacker
# would make it, bypassing Python's own argument checks. Arguments are passed as 64-bit values.
RAW_SYSCALL = """
import ctypes as _ct
_libc = _ct.CDLL(None, use_errno=True)
_libc.syscall.restype = _ct.c_long
def raw(nr, *args):
    _ct.set_errno(0)
    wide = [_ct.c_long(a) if a < 2**63 else _ct.c_ulong(a) for a in args]
    ret = _libc.syscall(_ct.c_long(nr), *wide)
    return ret, _ct.get_errno()
"""


def ok(execution):
    """Assert an execution raised nothing and return it."""
    assert execution.error is None, execution.error
    return execution


def evaluate(sandbox, code):
    """Run code in a kernel and return the value of its last expression (a Python literal)."""
    import ast

    execution = ok(sandbox.run(code))
    assert execution.text is not None, f"no result from {code!r}: {execution}"
    return ast.literal_eval(execution.text)


def wait_until_ready(client, process, timeout=60):
    """client.wait_for_ready, retried while the kernel process lives.

    A client without a manager judges liveness by the heartbeat alone, and reports a kernel that
    is still starting (no beat within a second, common on a loaded machine) as dead.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
            return
        except RuntimeError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise


def refused_folder(path, uid):
    """The refusal a kernel whose user code runs as uid gives for listing a folder outside its
    grants (the text after "Permission denied: 'path': ").

    Run as root, each kernel has a uid of its own, which a 0700 directory (pytest's tmp dirs,
    mkdtemp's) keeps out: then a grant alone would not help, and the kernel, unable to look,
    cannot tell a folder from a file, so it names the folder holding path.
    """
    import os
    from pathlib import Path

    reachable = os.geteuid() != 0 or all(
        folder.stat().st_mode & 0o001 for folder in Path(path).parents)
    readable = reachable and (os.geteuid() != 0 or Path(path).stat().st_mode & 0o005 == 0o005)
    named = path if reachable else os.path.dirname(path)
    grant = (f"reinstall the kernelspec with `sandbox-kernel install --read-path {named}` "
             f"(--write-path {named} to write there too), its other flags as before, and "
             "restart the kernel")
    if readable:
        return ("the sandbox refused it: the path is outside what this kernel was granted; "
                f"to let user code read it, {grant}")
    return ("the sandbox refused it: the path is outside what this kernel was granted, and the "
            f"host does not let its uid ({uid}) read it either; to let user code read it, make "
            "it readable by that uid (or have it run as a user who may read it: --run-as USER), "
            f"then {grant}")


def write_keys(path, entries):
    """An API keys file {"keys": entries} at path, readable by its owner only (as the service
    and the MCP server demand); the path."""
    import json
    import os

    path.write_text(json.dumps({"keys": entries}))
    os.chmod(path, 0o600)
    return path


def at_once(calls):
    """The answers of calls made from threads released in the same instant."""
    import threading

    answers = [None] * len(calls)
    together = threading.Barrier(len(calls))

    def call(number):
        together.wait()
        answers[number] = calls[number]()

    threads = [threading.Thread(target=call, args=(n,)) for n in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return answers
