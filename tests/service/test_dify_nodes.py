"""Dify's node types against `serve`, through a replica of Dify's own client logic (#19).

Each test is a row of docs/dify.md's node table: what Dify's executor makes of the service's
answer for a Python node, a Template (Jinja2) node, a JavaScript node (without and with
--nodejs-upstream) and an error in a node.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from .helpers import DIFY_KEY, RUN, Server, http
from .platform_client import CodeExecutionError, PlatformClient


@pytest.fixture(scope="module")
def platform(server):
    return PlatformClient(server.url)


def test_python_node(platform):
    code = "def main(a: int, b: int) -> dict:\n    return {'sum': a + b, 'text': 'é' * 2}\n"
    assert platform.execute(code, {"a": 40, "b": 2}) == {"sum": 42, "text": "éé"}


def test_template_node(platform):
    template = "{% for item in items %}{{ loop.index }}. {{ item | upper }}\n{% endfor %}"
    assert platform.render(template, {"items": ["tea", "café"]}) == "1. TEA\n2. CAFÉ\n"


def test_javascript_node_without_an_upstream_says_how_to_get_one(platform):
    with pytest.raises(CodeExecutionError) as caught:
        platform.execute_javascript("function main({a}) { return {r: a} }", {"a": 1})
    message = str(caught.value)
    assert message.startswith("Got error code: -400. Got error msg: nodejs is not available")
    assert "--nodejs-upstream URL" in message
    assert "network issue" not in message


def test_a_language_neither_knows_keeps_dify_sandboxs_400(server):
    for language in ("ruby", "javascript", "python2"):  # Dify sends "nodejs", never these
        answer = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY},
                           json={"language": language, "code": "x"})
        assert answer.status_code == 400, answer.text
        assert answer.content == b'{"code":-400,"message":"unsupported language","data":null}'


NODE_ERROR = """import json

def parse(text):
    return json.loads(text)

def main(text: str) -> dict:
    return {"value": parse(text)}
"""


def test_an_error_in_a_python_node_shows_the_users_frames_only(platform):
    with pytest.raises(CodeExecutionError) as caught:
        platform.execute(NODE_ERROR, {"text": "{broken"})
    message = str(caught.value)
    assert message.startswith("process exited with code 255\nTraceback (most recent call "
                              "last):\n"
                              '  File "<string>", line 7, in main\n'
                              '    return {"value": parse(text)}\n'
                              '  File "<string>", line 4, in parse\n'
                              "    return json.loads(text)\n")
    assert message.rstrip().endswith("JSONDecodeError: Expecting property name enclosed in "
                                     "double quotes: line 1 column 2 (char 1)")
    # Nothing of Dify's runner: not its call of main(), not the base64 inputs line.
    for wrapper in ("b64decode", "inputs_obj", "output_obj", "<<RESULT>>", "Cell In", "---->"):
        assert wrapper not in message


def test_an_error_in_a_template_shows_no_runner_frame(platform):
    with pytest.raises(CodeExecutionError) as caught:
        platform.render("{{ 1 / zero }}", {"zero": 0})
    message = str(caught.value)
    assert message.rstrip().endswith("ZeroDivisionError: division by zero")
    assert '  File "<template>", line 1, in <module>\nZeroDivisionError' in message
    for wrapper in ("b64decode", "inputs_obj", "jinja2.Template(", "Cell In"):
        assert wrapper not in message


def test_a_syntax_error_shows_its_line():
    from sandbox_kernel.service.dify.tracebacks import plain

    entries = ["  Cell In[1], line 1\n    def main(:\n             ^\n",
               "SyntaxError: invalid syntax\n"]
    assert plain(entries, 2) == ('  File "<string>", line 1\n    def main(:\n'
                                 "             ^\nSyntaxError: invalid syntax\n")


class FakeDifySandbox(BaseHTTPRequestHandler):
    """A stand-in for the operator's dify-sandbox: records each request, answers as it would."""

    received: ClassVar[list[tuple[str, dict[str, str], bytes]]] = []
    ANSWER = b'{"code":0,"message":"success","data":{"error":"","stdout":"<<RESULT>>{\\"r\\":3}' \
             b'<<RESULT>>\\n","stderr":""}}'

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, {k.lower(): v for k, v in self.headers.items()},
                              body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(self.ANSWER)))
        self.end_headers()
        self.wfile.write(self.ANSWER)

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.fixture(scope="module")
def upstream():
    fake = ThreadingHTTPServer(("127.0.0.1", 0), FakeDifySandbox)
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.shutdown()
    fake.server_close()


def test_nodejs_upstream_gets_the_request_unchanged(tmp_path, upstream):
    url = f"http://127.0.0.1:{upstream.server_address[1]}"
    server = Server(tmp_path, "--pool-size", "0", env={"SANDBOX_NODEJS_UPSTREAM": url})
    try:
        client = PlatformClient(server.url)
        assert client.execute_javascript("function main({a, b}) { return {r: a + b} }",
                                          {"a": 1, "b": 2}) == {"r": 3}
        path, headers, body = FakeDifySandbox.received[-1]
        assert path == RUN and headers["x-api-key"] == DIFY_KEY
        sent = json.loads(body)
        assert sent["language"] == "nodejs" and sent["enable_network"] is True
        assert re.search(r"output = main\(\{\n    \"a\": 1,", sent["code"])
        body = b'{"language": "nodejs", "code": "console.log(\\"\\u00e9\\")", "preload": ""}'
        answer = http.post(server.url + RUN, content=body, headers={
            "X-Api-Key": DIFY_KEY, "Content-Type": "application/json"})
        assert FakeDifySandbox.received[-1][2] == body  # forwarded byte for byte
        assert answer.content == FakeDifySandbox.ANSWER  # and its answer relayed as it is
        assert answer.headers["content-type"] == "application/json; charset=utf-8"
        assert http.post(server.url + RUN, headers={"X-Api-Key": "wrong-key-0123456789"},
                         json={"language": "nodejs", "code": "1"}).status_code == 401
        upstream.shutdown()
        upstream.server_close()
        with pytest.raises(CodeExecutionError) as caught:
            client.execute_javascript("function main() { return {} }", {})
        assert f"the nodejs upstream {url} could not answer" in str(caught.value)
        assert "check --nodejs-upstream" in str(caught.value)
    finally:
        server.stop()
