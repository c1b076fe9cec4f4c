"""The HTTP service (`sandbox-kernel serve`): the dify-sandbox-compatible API and the native one.

- `app.py` builds the ASGI app: routers, the exception handlers of `errors.py`, middleware;
  `serve.py` runs it under uvicorn with the settings of `config.py`.
- `core.py` holds the running `Service`; routes get it, the caller's key and session through
  the typed dependencies of `deps.py`.
- `dify/` is dify-sandbox's face (gin's binding and answers, as bytes); `native/` is `/api/v1`,
  one router per resource (executions, sessions, files).
- Underneath: `kernels.py` (where kernels come from), `runs.py` (admission, deadlines, output
  budgets), `sessions.py`, `auth.py`, `access.py` + `metrics.py` (the log and counters),
  `limits.py` (body size), `validation.py` (what JSON can carry).
"""
