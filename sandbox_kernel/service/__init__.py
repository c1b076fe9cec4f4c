"""The HTTP service (`sandbox-kernel serve`): the dify-sandbox-compatible API and the native one."""
