"""A route's usual request answered without FastAPI's dependency solving; any other, with it.

FastAPI solves a route's dependencies anew on every request (the service, the key, the
credentials, the body): a tenth of the service process's CPU for a native one-shot run, a
sixteenth for a dify run (measured with both routes answered directly, 2026-12). A route of
`DirectRoute` may name a direct way (`serve_directly`) for its usual request: it takes the
request, and either answers it by calling the route's endpoint itself, with the same values
FastAPI would have passed (each found by the code FastAPI calls for it), or gives it back
(None) before anything happened, and FastAPI answers as always. So every answer other than the
usual one (a refused key, a bad body, a validation error), and which check speaks first, stays
FastAPI's own; and what the endpoint raises goes to the app's exception handlers either way.

The direct way may read the body first (Starlette keeps it on the request, where FastAPI then
finds it); an error reading it other than an HTTP one (a body past --max-body) is given back
the same way, and FastAPI's own reading meets it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

Direct = Callable[[Request], Awaitable[Response | None]]
_DIRECT: dict[Callable[..., Any], Direct] = {}


def serve_directly(endpoint: Callable[..., Any], direct: Direct) -> None:
    """Answer the usual request of endpoint's route (a DirectRoute) with direct."""
    _DIRECT[endpoint] = direct


class DirectRoute(APIRoute):
    """An APIRoute whose endpoint may have a direct way for its usual request."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, after the endpoint's direct way where it has one."""
        through_fastapi = super().get_route_handler()
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            direct = _DIRECT.get(endpoint)
            response = None if direct is None else await direct(request)
            return response if response is not None else await through_fastapi(request)

        return handler


async def json_body(request: Request) -> bytes | None:
    """The body of a request sent as `application/json` (exactly: the form every client of
    these routes sends), or None for any other (FastAPI then reads it, or meets the error
    reading it met)."""
    if request.headers.get("content-type") != "application/json":
        return None
    try:
        return await request.body()
    except HTTPException:
        raise  # e.g. past --max-body: as FastAPI passes it on
    except Exception:
        return None
