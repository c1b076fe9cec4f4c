"""A client written like Dify's code executor: its transformers' runners and its error rules.

A minimal replica that follows Dify's logic (api/core/helper/code_executor: code_executor.py's
response handling, the Python3, Jinja2 and Node.js template transformers); no code of Dify's.
"""

from __future__ import annotations

import base64
import json
import re

from .helpers import DIFY_KEY, httpx


class CodeExecutionError(Exception):
    pass


RUNNER = """{code}

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

# Dify's Jinja2 transformer: the template inside a main() that renders it with the inputs.
JINJA2_RUNNER = """
# declare main function here
def main(**inputs):
    import jinja2
    template = jinja2.Template('''{code}''')
    return template.render(**inputs)

import json
from base64 import b64decode

# decode and prepare input dict
inputs_obj = json.loads(b64decode('{inputs}').decode('utf-8'))

# execute main function
output = main(**inputs_obj)

# convert output and print
result = f'''<<RESULT>>{{output}}<<RESULT>>'''
print(result)
"""

# Dify's Node.js transformer: the inputs as a JSON literal, the result through console.log.
NODEJS_RUNNER = """// declare main function here
{code}

// execute main function, and return the result
// inputs is a dict, unstructured inputs
output = main({inputs})

// convert output to json and print
output = JSON.stringify(output)

result = `<<RESULT>>${{output}}<<RESULT>>`

console.log(result)
"""

DEFAULT_TEMPLATE = '''def main(arg1: str, arg2: str) -> dict:
    return {
        "result": arg1 + arg2,
    }
'''


class PlatformClient:
    """Posts the runner script with X-Api-Key and applies the platform's error rules."""

    def __init__(self, endpoint: str, key: str = DIFY_KEY) -> None:
        self.endpoint, self.key = endpoint, key
        self.http = httpx.Client(timeout=httpx.Timeout(60, connect=10, write=10),
                                 limits=httpx.Limits(max_connections=100))

    def execute(self, code: str, inputs: dict) -> dict:
        """A Python code node: main(**inputs)'s dict."""
        runner = RUNNER.format(code=code, inputs=_encoded(inputs))
        found = re.search(r"<<RESULT>>(.*?)<<RESULT>>", self.run("python3", runner), re.DOTALL)
        if not found:
            raise CodeExecutionError("Failed to parse result")
        result = json.loads(found.group(1))
        if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
            raise CodeExecutionError("Result must be a dict with string keys")
        return result

    def render(self, template: str, inputs: dict) -> str:
        """A Template node: the rendered text (Jinja2, run as python3)."""
        runner = JINJA2_RUNNER.format(code=template, inputs=_encoded(inputs))
        found = re.search(r"<<RESULT>>(.*)<<RESULT>>", self.run("python3", runner), re.DOTALL)
        if not found:
            raise CodeExecutionError("Failed to parse result")
        return found.group(1)

    def execute_javascript(self, code: str, inputs: dict) -> dict:
        """A JavaScript code node (run as nodejs)."""
        runner = NODEJS_RUNNER.format(code=code,
                                      inputs=json.dumps(inputs, indent=4, ensure_ascii=False))
        found = re.search(r"<<RESULT>>(.*)<<RESULT>>", self.run("nodejs", runner), re.DOTALL)
        if not found:
            raise CodeExecutionError("Failed to parse result")
        return json.loads(found.group(1))

    def run(self, language: str, runner: str) -> str:
        """POST /v1/sandbox/run as Dify's executor does; its stdout, or Dify's error."""
        try:
            response = self.http.post(
                f"{self.endpoint}/v1/sandbox/run", headers={"X-Api-Key": self.key},
                json={"language": language, "code": runner, "preload": "",
                      "enable_network": True})
            if response.status_code == 503:
                raise CodeExecutionError("Code execution service is unavailable")
            if response.status_code != 200:
                raise RuntimeError(f"Failed to execute code, got status code "
                                   f"{response.status_code}, please check if the sandbox "
                                   "service is running")
        except CodeExecutionError:
            raise
        except Exception as exc:
            raise CodeExecutionError(f"Failed to execute code, which is likely a network "
                                     f"issue, please check if the sandbox service is running. "
                                     f"( Error: {exc} )") from exc
        try:
            body = response.json()
        except ValueError as exc:
            raise CodeExecutionError("Failed to parse response") from exc
        if body["code"] != 0:
            raise CodeExecutionError(f"Got error code: {body['code']}. Got error msg: "
                                     f"{body['message']}")
        if body["data"].get("error"):
            raise CodeExecutionError(body["data"]["error"])
        return str(body["data"]["stdout"])


def _encoded(inputs: dict) -> str:
    return base64.b64encode(json.dumps(inputs, ensure_ascii=False).encode()).decode()
