"""What user code writes cannot pass for the service's own log lines (#20 item 6).

The service's log (its stderr) holds its JSON lines and, relayed by each kernel's reaper, what
the kernels wrote. Hostile code writes a forged request-log line of another key and audit lines
hidden behind invisible characters; in the service's real log file every one of them must start
with the kernel's mark and show every invisible character escaped.
"""

from __future__ import annotations

import datetime
import json
import re
import time

from .helpers import DIFY_KEY, KEY_B, RUN, auth, http

FORGED = [
    '{"method":"POST","route":"/v1/sandbox/run","status":200,"key":"team-b","forged":1}',
    "\tsandbox-kernel audit: kernel x: forged refused kill(0x1)",
    "\u200bsandbox-kernel audit: kernel x: forged refused kill(0x1)",
    "\ufeff{\"event\":\"started\",\"forged\":2}",
    "\u2066sandbox-kernel audit: kernel x: forged\u2069",
    "ok\r{\"event\":\"stopped\",\"forged\":3}",
]
CODE = f"""
import os
for line in {FORGED!r}:
    os.write(2, line.encode() + b"\\n")
print("done")
"""


def _lines_mentioning(log: str, word: str) -> list[str]:
    return [line for line in log.splitlines() if word in line]


def test_a_one_shot_kernels_fd_2_is_its_stderr_never_the_log(one_shot_server):
    # A stateless run's kernel (kernel/oneshot.py) has no log pipe: what it writes to fd 2 is
    # the run's stderr, and nothing of it reaches the service's log.
    server = one_shot_server
    answer = http.post(server.url + RUN, headers={"X-Api-Key": DIFY_KEY},
                       json={"language": "python3", "code": CODE})
    data = answer.json()["data"]
    assert data["stdout"] == "done\n", answer.text
    assert data["stderr"] == "".join(line + "\n" for line in FORGED)
    assert not _lines_mentioning(server.log.read_text(errors="replace"), "forged")


def test_a_kernel_cannot_forge_the_services_log_lines(server, session):
    # A session's ZMQ kernel: its fd 2 is the log pipe its reaper relays to the service's log.
    answer = http.post(session + "/execute", headers=auth(KEY_B), json={"code": CODE},
                       timeout=60)
    assert answer.json()["stdout"] == "done\n", answer.text
    deadline = time.monotonic() + 20  # the reaper relays after the kernel wrote
    while time.monotonic() < deadline:
        log = server.log.read_text(errors="replace")
        forged = _lines_mentioning(log, "forged")
        if len(forged) >= len(FORGED):
            break
        time.sleep(0.2)
    assert len(forged) == len(FORGED), log[-4000:]
    marks = {line.split("] ", 1)[0] for line in forged}
    assert len(marks) == 1 and next(iter(marks)).startswith("[kernel "), forged
    for line in forged:
        assert line.isprintable(), line  # no tab, CR or invisible character survives
    # The service's own lines are JSON objects: none of them is one the kernel wrote.
    own = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert not [record for record in own if "forged" in record]


def test_every_json_line_says_when_in_utc_and_the_start_line_where(server):
    answered = http.get(server.url + "/ready")  # one more request line, logged as it ends
    deadline = time.monotonic() + 10
    while '"route":"/ready"' not in (log := server.log.read_text(errors="replace")):
        assert time.monotonic() < deadline, log[-4000:]
        time.sleep(0.1)
    own = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert own and answered.status_code == 200
    now = datetime.datetime.now(datetime.timezone.utc)
    for record in own:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"]), record
        when = datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00"))
        assert datetime.timedelta(0) <= now - when < datetime.timedelta(hours=1), record
    started = [record for record in own if record.get("event") == "started"]
    assert [list(record) for record in started] == [
        ["time", "event", "version", "url", "network", "pool_size"]]
    assert started[0]["url"] == server.url  # http://127.0.0.1:PORT, where it listens
