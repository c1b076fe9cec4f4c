"""The dify-sandbox compatible face: `/health` and `/v1/sandbox/*`, matched at the HTTP level.

dify-sandbox is a gin server; `gin.py` reproduces its JSON and request binding as bytes,
`answers.py` its runner's exit codes and error text, `routes.py` the routes themselves.
"""

from .routes import router

__all__ = ["router"]
