"""Payloads arrive exact, with orjson installed (jupyter_client then uses it) and without it."""

import json
import subprocess
import sys
import textwrap

import jupyter_client.session
import pytest

from sandbox_kernel import jsonwire
from sandbox_kernel.kernel import peeking
from tests.helpers import ok

BIG = "def main(x):\n    return {'x': x, 'up': 2**70, 'down': -2**70, 'edge': 2**64, 'f': 0.1}"
BIG_RESULT = {"x": 2**70, "up": 2**70, "down": -(2**70), "edge": 2**64, "f": 0.1}
ECHO = "def main(rows):\n    return {'rows': rows}"


def ten_mb_rows():
    """About 10 MB of JSON records, with integers past 64 bits among them."""
    return [{"id": i, "name": f"item-{i:08d}", "value": i / 4, "big": 2**70 + i}
            for i in range(140_000)]


def test_orjson_is_what_jupyter_client_would_use_here():
    """The tests below mean something only if jupyter_client picked orjson in this process."""
    assert jupyter_client.session.has_orjson and jsonwire.orjson is not None


def test_integers_past_64_bits_arrive_exact_both_ways(sandbox):
    ex = ok(sandbox.run(BIG, inputs={"x": 2**70}))
    assert ex.result == BIG_RESULT
    assert all(type(ex.result[key]) is int for key in ("x", "up", "down", "edge"))


def test_a_ten_mb_result_arrives_exact(sandbox):
    rows = ten_mb_rows()
    ex = ok(sandbox.run(ECHO, inputs={"rows": rows}))
    assert ex.result == {"rows": rows}
    assert type(ex.result["rows"][-1]["big"]) is int


@pytest.mark.parametrize(("returned", "problem"), [
    ("{'k': '\\ud800'}", "result[\"k\"]: str with a lone surrogate '\\ud800' at index 0"),
    ("{'\\udfff': 1}", "result[\"\\udfff\"] (the key): str with a lone surrogate"),
    ("{'n': [1, float('nan')]}", "result[\"n\"][1]: float nan (NaN and Infinity are not JSON)"),
    ("{'n': None, 'i': float('inf')}", "result[\"i\"]: float inf"),
    ("{1: 2}", "result[1]: int key (JSON keys are strings)"),
])
def test_results_that_cannot_be_sent_are_invalid_results(sandbox, returned, problem):
    ex = sandbox.run(f"def main():\n    return {returned}", inputs={})
    assert ex.error is not None and ex.error.name == "InvalidResult", ex
    assert ex.error.value.startswith(f"main() returned a value that is not JSON: {problem}")
    assert ex.result is None
    assert ok(sandbox.run("def main():\n    return {'alive': True}", inputs={})).result == {
        "alive": True}


def test_jsonwire_is_exact_where_orjson_is_not():
    assert jsonwire.loads(b'{"x": 1180591620717411303424}') == {"x": 2**70}
    assert jsonwire.loads(b"[-9223372036854775809]") == [-(2**63) - 1]
    assert jsonwire.loads(b'{"b": 1, "a": 2}') == {"b": 1, "a": 2}
    assert list(jsonwire.loads(b'{"b": 1, "a": 2}')) == ["b", "a"]  # key order kept
    assert jsonwire.encode_result({"x": 2**70}) == b'{"x":1180591620717411303424}'
    with pytest.raises(jsonwire.NotJSON, match="NaN and Infinity"):
        jsonwire.encode_result({"x": None, "y": float("nan")})


@pytest.mark.parametrize("offset", [13, 65536 - 19, 65536 - 10, 65536 - 1, 65536, 3 * 65536 - 7])
@pytest.mark.parametrize("number", [2**70 + 1, -(2**63) - 1])
def test_a_long_integer_anywhere_in_a_large_text_is_exact(offset, number):
    """The digit scan goes piece by piece: a number across a piece boundary is still seen."""
    digits = str(abs(number)).encode()
    padding = '"' + "x" * (offset - 12 - (number < 0)) + '"'
    text = f'{{"p":{padding},"n":{number}}}'.encode() + b" " * 70000
    assert text.index(digits) == offset
    value = jsonwire.loads(text)["n"]
    assert value == number and isinstance(value, int)


def test_nan_is_refused_and_null_kept_whatever_the_text_holds():
    assert jsonwire.encode_result({"big": [1.5, "null", None, 2**64]}) == \
        b'{"big":[1.5,"null",null,18446744073709551616]}'
    with pytest.raises(jsonwire.NotJSON, match=r'result\["rows"\]\[2\]: float inf'):
        jsonwire.encode_result({"rows": ["null", None, float("inf")]})


# Without orjson: the client in a process of its own, and a kernel whose interpreter cannot
# import it either (the kernel re-executes itself with the same -c, so it stays hidden there).
HIDE = "import sys; sys.modules['orjson'] = None"
WITHOUT_ORJSON = HIDE + "\n" + textwrap.dedent("""
    import json
    import jupyter_client.session
    from sandbox_kernel import client, install, jsonwire
    from sandbox_kernel.policy import SandboxPolicy
    from tests.test_payload import BIG, ECHO, ten_mb_rows

    assert jsonwire.orjson is None and not jupyter_client.session.has_orjson
    spec = install.kernel_json(SandboxPolicy(), "sandbox without orjson")
    run_module = "import runpy; runpy.run_module('sandbox_kernel', run_name='__main__')"
    spec["argv"][1:4] = ["-I", "-c", KERNEL_HIDE + "; " + run_module]
    sandbox = client.Sandbox(None)
    from jupyter_client.kernelspec import KernelSpec
    sandbox.manager.kernel_spec_manager.spec = KernelSpec(**spec)
    with sandbox:
        hidden = sandbox.run("import sys\\nprint(sys.modules.get('orjson', 'absent'))")
        big = sandbox.run(BIG, inputs={"x": 2**70})
        rows = ten_mb_rows()
        echo = sandbox.run(ECHO, inputs={"rows": rows})
    print(json.dumps({"hidden": hidden.stdout, "big": repr(big.result),
                      "echo_exact": echo.result == {"rows": rows}, "errors": repr(
                      [big.error, echo.error])}))
""")


def test_exact_without_orjson_on_either_side(jupyter_root):
    script = f"KERNEL_HIDE = {HIDE!r}\n" + WITHOUT_ORJSON
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=110, check=False, cwd=str(_repo()))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["hidden"] == "None\n"  # the kernel's interpreter could not import orjson
    assert report["big"] == repr(
        {"x": 2**70, "up": 2**70, "down": -(2**70), "edge": 2**64, "f": 0.1})
    assert report["echo_exact"] is True and report["errors"] == "[None, None]"


def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


# --- the kernel's session: a large request's signature is computed once, by the peek ----------

def _kernel_session():
    session = jupyter_client.session.Session(key=b"secret")
    peeking.use_in_kernel(session)
    return session


def _large_request(session):
    msg = session.msg("execute_request", {"code": "pass"},
                      metadata={"sandbox": {"inputs": {"rows": ["x" * 100] * 2000}}})
    return session.serialize(msg)[1:]  # the parts after the delimiter: signature first


def _on_another_thread(session, parts, content=False):
    """deserialize on a thread other than the main one (a peek by default), as the kernel's
    shell-channel (or control) thread does; its error is raised here."""
    import threading

    outcome = []

    def deserialize():
        try:
            outcome.append(session.deserialize(list(parts), content=content))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=deserialize)
    thread.start()
    thread.join()
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def test_the_main_thread_trusts_a_signature_its_peek_verified(monkeypatch):
    session = _kernel_session()
    parts = _large_request(session)
    peeked = _on_another_thread(session, parts)
    assert isinstance(peeked["metadata"], peeking.Unparsed)  # the inputs were not parsed
    computed = []
    original = jupyter_client.session.Session.sign
    monkeypatch.setattr(jupyter_client.session.Session, "sign",
                        lambda self, msg_list: computed.append(1) or original(self, msg_list))
    msg = session.deserialize(list(parts))
    assert msg["metadata"]["sandbox"]["inputs"]["rows"][0] == "x" * 100
    assert computed == []  # the peek's check stands
    with pytest.raises(ValueError, match="Duplicate Signature"):  # replays are still refused
        session.deserialize(list(parts))


def test_every_other_signature_is_checked_in_full():
    session = _kernel_session()
    parts = _large_request(session)
    forged = [parts[0], *parts[1:3], parts[3].replace(b"xxxx", b"yyyy", 1), *parts[4:]]
    with pytest.raises(ValueError, match="Invalid Signature"):  # the peek refuses a forgery
        _on_another_thread(session, forged)
    with pytest.raises(ValueError, match="Invalid Signature"):  # unpeeked: checked in full
        session.deserialize(list(forged))
    parts = _large_request(session)
    _on_another_thread(session, parts)
    forged = [parts[0], *parts[1:3], parts[3].replace(b"xxxx", b"yyyy", 1), *parts[4:]]
    with pytest.raises(ValueError, match="Invalid Signature"):  # other threads: in full
        _on_another_thread(session, forged, content=True)  # e.g. the control thread
