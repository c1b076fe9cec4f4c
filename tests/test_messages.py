"""The message builder (kernel/messages.py) makes the frames jupyter_client's Session makes."""

import math
import warnings
from datetime import datetime, timezone

import pytest
from jupyter_client.session import Session, json_packer

from sandbox_kernel import jsonwire
from sandbox_kernel.kernel import messages

REQUEST = {"header": {"msg_id": "r1", "msg_type": "execute_request", "username": "u",
                      "session": "s", "date": "2026-01-01T00:00:00Z", "version": "5.4"},
           "parent_header": {}, "metadata": {}, "content": {"code": "1"}}
# The messages a one-shot sends, as its senders pass them to Session.send.
SENT = [
    ("stream", {"name": "stdout", "text": "héllo\n"}, b"stream.stdout", None),
    ("display_data", {"data": {"text/plain": "x", "image/png": "iVBO"}, "metadata": {},
                      "transient": {}}, b"kernel.k.display_data", None),
    ("execute_result", {"execution_count": 1, "data": {"application/json": {"n": 2**70}},
                        "metadata": {}}, b"kernel.k.execute_result", None),
    ("error", {"ename": "ValueError", "evalue": "bad \u2603", "traceback": ["\x1b[0;31m"]},
     b"kernel.k.error", None),
    ("execute_reply", {"status": "ok", "execution_count": 1, "user_expressions": {}},
     [b"route"], {"sandbox": {"usage": {"cpu_seconds": 0.001, "when": datetime(
         2026, 1, 1, tzinfo=timezone.utc)}}, "started": datetime.now(timezone.utc)}),
    ("status", {"execution_state": "idle"}, b"kernel.k.status", None),
    ("sandbox_tool_request", {"tool": "f", "args": [1.5, None, True], "kwargs": {}}, None,
     None),
]


@pytest.mark.parametrize(("msg_type", "content", "ident", "metadata"), SENT,
                         ids=[sent[0] for sent in SENT])
def test_frames_are_the_sessions(msg_type, content, ident, metadata):
    session = Session(key=b"", username="kernel")
    built = messages.Messages("kernel", session.session)
    ours = built.msg(msg_type, content, REQUEST, metadata=metadata)
    theirs = session.msg(msg_type, content, REQUEST, metadata=metadata)
    assert ours["header"].pop("date").tzinfo is not None
    theirs["header"].pop("date")
    assert ours == theirs  # the same shape: keys, ids (session, pid, count), parent, metadata
    ours["header"]["date"] = datetime.now(timezone.utc)
    assert list(ours["header"]) == ["msg_id", "msg_type", "username", "session", "version",
                                    "date"]
    assert messages.serialize(ours, ident) == session.serialize(ours, ident)


def test_a_parent_given_by_its_header_and_none():
    head = messages.header("m", "status", "kernel", "s")
    assert messages.message(head, None, REQUEST["header"])["parent_header"] == REQUEST["header"]
    assert messages.message(head)["parent_header"] == {} == messages.message(head)["content"]
    with pytest.raises(KeyError):
        messages.parent_header({"content": {}})


@pytest.mark.parametrize("value", [
    {"big": 2**70, "nan": math.nan}, {1: "int key", "t": (1, 2)}, {"b": b"\x00\xff"},
    {"naive": datetime(2026, 1, 1, 12)}, {"set": {3}, "inf": -math.inf},
    {"s": "\ud800 lone"}, {"n": 2**64 - 1, "f": 1e308}])
@pytest.mark.parametrize("with_orjson", [True, False])
def test_parts_are_packed_as_jupyter_client_packs_them(value, with_orjson, monkeypatch):
    pack = Session().pack if with_orjson else json_packer
    if not with_orjson:
        monkeypatch.setattr(jsonwire, "orjson", None)
    try:
        with warnings.catch_warnings():  # jupyter_client's deprecated cleaning warns
            warnings.simplefilter("ignore")
            expected = pack(value)
    except ValueError as exc:  # not JSON even cleaned (a lone surrogate): both refuse
        with pytest.raises(type(exc)):
            jsonwire.pack_message(value)
        return
    assert jsonwire.pack_message(value) == expected


def test_what_the_builder_sends_the_session_reads():
    sent = []

    class Channel:
        def send_multipart(self, frames):
            sent.append(frames)

    built = messages.Messages()
    msg = built.send(Channel(), "sandbox_tool_reply", {"value": 2**70}, REQUEST,
                     ident=[b"a", b"b"], buffers=[b"raw"])
    idents, parts = messages.split_identities(sent[0])
    assert idents == [b"a", b"b"]
    theirs = Session(key=b"").deserialize(parts)
    ours = messages.deserialize(parts)
    assert ours["content"] == theirs["content"] == {"value": 2**70}
    assert ours["header"]["msg_id"] == theirs["header"]["msg_id"] == msg["msg_id"]
    assert ours["parent_header"]["msg_id"] == "r1"
    assert bytes(ours["buffers"][0]) == b"raw"
    with pytest.raises(ValueError, match="signed"):
        messages.deserialize([b"sig", *parts[1:]])
    built.renew()
    assert built.next_id().endswith("_0")
