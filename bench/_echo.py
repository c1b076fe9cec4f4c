"""The floor of a JSON round trip: a fast-JSON echo behind one ZMQ hop.

Started as `python -I _echo.py`; prints its port, then answers every request with the same
JSON object it parsed (orjson, the garbage collector paused), until it gets an empty message.
"""

import gc

import orjson
import zmq


def serve() -> None:
    """Echo JSON objects over a REP socket on 127.0.0.1."""
    socket = zmq.Context().socket(zmq.REP)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    while request := socket.recv(copy=False).buffer:
        gc.disable()
        value = orjson.loads(request)
        gc.enable()
        socket.send(orjson.dumps({"rows": value["rows"]}))
    socket.send(b"")


if __name__ == "__main__":
    serve()
