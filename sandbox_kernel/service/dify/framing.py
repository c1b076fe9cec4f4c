"""Dify's result framing kept whole, however much the code printed before it.

Dify's runners end with `result = f'''<<RESULT>>{X}<<RESULT>>'''` and `print(result)`, and Dify
reads the text between the markers from stdout. A kernel keeps at most --max-output bytes of
stream output per execution; a node whose logs passed that cap lost its closing marker, and
Dify failed it with "Failed to parse result" where dify-sandbox (no cap) had answered. So the
route runs that last print as a main()-style call instead: the framed text comes back as the
execution's result (bounded by --max-result, not by the output cap) and is put after the logs,
which the kernel cut where they passed the cap, with its marker saying so (also in stdout, just
before the result). A result the kernel or the service refuses is said in the node's terms
(`explained`): ENTRYPOINT is this module's name, which the node's author never wrote.
"""

from __future__ import annotations

import json
import re

from ...client import ErrorInfo, Execution
from ...errors import ResultTooLarge

# The last two lines of Dify's Python and Jinja2 runners (api/core/helper/code_executor/).
_TAIL = re.compile(r"\nresult = f'''<<RESULT>>\{(?P<value>\w+)\}<<RESULT>>'''\n"
                   r"print\(result\)\s*\Z")
ENTRYPOINT = "_dify_framed_result"
# The kernel's marker for output past its cap (sandbox_kernel.kernel.output), on stderr.
# The kernel's (kernel/main_call.py) and the client's (client/receive.py) words for a result past
# --max-result: its size, then the limit.
_TOO_LARGE = re.compile(r"(?:returned|sent) (?:a )?([\d,]+)(?:-byte| bytes of JSON).*? limit of "
                        r"([\d,]+) bytes")
_CUT = re.compile(r"\n\[sandbox-kernel: output limit of [\d,]+ bytes per execution reached; "
                  r"[\d,]+ more bytes were dropped \(--max-output raises the limit\)\]\n")


def split(code: str) -> str | None:
    """The runner with its last print turned into ENTRYPOINT; None if code is not a runner.

    The lines before keep their numbers: tracebacks point at the same lines as before.
    """
    found = _TAIL.search(code)
    if found is None:
        return None
    return (f"{code[:found.start()]}\nresult = f'''<<RESULT>>{{{found['value']}}}<<RESULT>>'''\n"
            f"def {ENTRYPOINT}():\n    return {{'framed': result}}\n")


def framed_stdout(execution: Execution, stdout: str, stderr: str) -> str:
    """stdout as the runner's print would have ended it: the logs, then the framed result;
    where the kernel cut the logs, its marker (on stderr) between them, so stdout says so too."""
    if execution.error is not None or execution.result_json is None:
        return stdout
    cut = _CUT.search(stderr)
    marker = cut.group(0) if cut else ""  # on a line of its own after a cut mid-line
    return stdout + marker + json.loads(execution.result_json)["framed"] + "\n"


def explained(execution: Execution) -> None:
    """Say a refused result of the runner as its node's author needs it: how large the node's
    result was, which limit it passed and what to do, never naming ENTRYPOINT."""
    error = execution.error
    if error is None or (ENTRYPOINT not in error.value and error.name != ResultTooLarge.code):
        return
    sizes = _TOO_LARGE.search(error.value)
    if sizes:
        text = (f"the node's result is {sizes[1]} bytes (as the runner frames it, JSON in "
                f"<<RESULT>>), more than this sandbox's limit of {sizes[2]} bytes for a "
                "result: return less from main() (large data belongs in a file or a store, "
                "not in the node's output), or have the sandbox's operator raise the limit "
                "(sandbox-kernel serve --max-result)")
    else:
        text = error.value.replace(f"{ENTRYPOINT}()", "the node's result")
    execution.error = ErrorInfo(error.name, text, [f"{error.name}: {text}"])
