"""What routes ask FastAPI for, as typed aliases: the service, the caller's key, their session.

Routes take `service: ServiceDep`, `key: Key`, `session: OwnedSession` as parameters instead of
reaching into `request.app.state`, so each route's signature says what it needs.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..hosting.keys import ApiKey
from ..hosting.sessions import Session
from .core import Service

bearer = HTTPBearer(auto_error=False, description="An API key from the keys file.")


async def service(request: Request) -> Service:
    """The running service the app was created with (async: FastAPI runs a plain function
    dependency in its thread pool, a thread hop per request for an attribute read)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(service)]


def known_key(service: Service, credentials: HTTPAuthorizationCredentials | None
              ) -> ApiKey | None:
    """The known bearer key of these credentials, or None."""
    token = f"Bearer {credentials.credentials}" if credentials else None
    return service.bearer_keys.find(token)


def taken(request: Request, key: ApiKey) -> ApiKey:
    """The key the request is served for, noted for its access log line."""
    request.state.key_id = key.id
    return key


async def api_key(request: Request, service: ServiceDep,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
                  ) -> ApiKey:
    """The bearer key of the request; 401 without a known one."""
    key = known_key(service, credentials)
    if key is None:
        service.metrics.denials.labels(reason="bad_key").inc()
        raise HTTPException(401, "a valid API key is required: Authorization: Bearer <key>",
                            headers={"WWW-Authenticate": "Bearer"})
    return taken(request, key)


Key = Annotated[ApiKey, Depends(api_key)]


async def session_of(request: Request, service: Service, key: ApiKey,
                     session_id: str) -> Session:
    """The key's session by that id (SessionError 404 if it has none), noted for the access log;
    a paused one is resumed first, on a fresh kernel restored from its snapshot.

    Routes with a body or a path to check call it after those checks, so a bad request is told
    so before the session is looked up.
    """
    pausing = service.pausing
    if pausing is not None and service.sessions.find(key.id, session_id) is None:
        await pausing.resume(key, session_id)
    session = service.sessions.get(key, session_id)
    request.state.session_id = session.id
    request.state.kernel_id = session.kernel_id
    return session


async def owned_session(session_id: str, request: Request, service: ServiceDep,
                        key: Key) -> Session:
    """The key's session named in the path (resumed if it was paused)."""
    return await session_of(request, service, key, session_id)


OwnedSession = Annotated[Session, Depends(owned_session)]


def run_timeout(service: Service, asked: float | None, in_session: bool = False) -> float:
    """The seconds a run may take: the caller's ask within --max-timeout, else the default
    (--session-timeout in a session, --worker-timeout on a fresh kernel)."""
    config = service.config
    if asked is None:
        return float(config.session_timeout if in_session else config.worker_timeout)
    if asked > config.max_timeout:
        raise HTTPException(400, f"timeout {asked:g} s is above this service's limit of "
                            f"{config.max_timeout:g} s (--max-timeout)")
    return asked
