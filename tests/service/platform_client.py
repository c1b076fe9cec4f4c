"""A client written like the platform's code executor: the runner script, its error rules."""

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
        encoded = base64.b64encode(json.dumps(inputs, ensure_ascii=False).encode()).decode()
        runner = RUNNER.format(code=code, inputs=encoded)
        try:
            response = self.http.post(
                f"{self.endpoint}/v1/sandbox/run", headers={"X-Api-Key": self.key},
                json={"language": "python3", "code": runner, "preload": "",
                      "enable_network": True})
        except httpx.HTTPError as exc:
            raise CodeExecutionError("Failed to execute code") from exc
        if response.status_code == 503:
            raise CodeExecutionError("Code execution service is unavailable")
        if response.status_code != 200:
            raise CodeExecutionError(f"Failed to execute code, got status {response.status_code}")
        try:
            body = response.json()
        except ValueError as exc:
            raise CodeExecutionError("Failed to parse response") from exc
        if body["code"] != 0:
            raise CodeExecutionError(f"Got error code: {body['code']}. Got error msg: "
                                     f"{body['message']}")
        if body["data"].get("error"):
            raise CodeExecutionError(body["data"]["error"])
        found = re.search(r"<<RESULT>>(.*?)<<RESULT>>", body["data"]["stdout"], re.DOTALL)
        if not found:
            raise CodeExecutionError("Failed to parse result")
        result = json.loads(found.group(1))
        if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
            raise CodeExecutionError("Result must be a dict with string keys")
        return result
