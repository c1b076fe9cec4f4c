"""The file operations that run inside a kernel: imported by a one-shot, sent to a ZMQ one.

The client (client/files.py) reads this file's text and defines it in a ZMQ kernel once, then
calls its entry point `__sandbox_files__` with the `main()` convention; a one-shot kernel,
whose scratch ends with it, imports it (kernel/oneshot.py) and calls it after the run when its
caller asks to keep the files the run wrote. It imports nothing but the standard library.
Inside the kernel it reaches only what the kernel's own code could, under its Landlock rules.
Its error texts reach the service's callers as they are (the MCP server words them again for a
model).
"""


def __sandbox_files__(op, path=".", data=None, limit=0, since=0.0, embed=0, budget=0):
    import base64
    import os
    home = os.path.realpath(os.path.expanduser("~"))
    target = os.path.realpath(os.path.join(home, path))
    if os.path.commonpath([home, target]) != home:
        raise PermissionError(f"{path} leads outside the scratch directory")
    if op == "write":
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as file:
            file.write(base64.b64decode(data))
        return {"path": path, "size": os.path.getsize(target)}
    if op == "list":  # files (hidden ones left out) changed since `since`, at most `limit`
        found, more = [], False
        for root, dirs, names in os.walk(target):
            dirs[:] = sorted(name for name in dirs if not name.startswith("."))
            for name in sorted(names):
                full = os.path.join(root, name)
                try:
                    info = os.stat(full)
                except OSError:
                    continue
                if name.startswith(".") or info.st_mtime < since:
                    continue
                if len(found) >= limit:
                    more = True
                    break
                found.append([os.path.relpath(full, home), info.st_size, info.st_mtime])
        return {"files": found, "more": more}
    if op == "keep":  # the listing, and the files up to `embed` bytes read, `budget` in all
        listed = __sandbox_files__("list", path, limit=limit, since=since)
        listed["embedded"] = {}
        for name, size, _ in listed["files"]:
            if size <= embed and size <= budget:
                try:
                    listed["embedded"][name] = __sandbox_files__("read", name, limit=embed)
                except (OSError, ValueError):  # gone or grown since it was listed
                    continue
                budget -= size
        return listed
    size = os.path.getsize(target)
    if size > limit:
        raise ValueError(f"{path} is {size} bytes, above the {limit}-byte limit")
    with open(target, "rb") as file:
        content = file.read(limit + 1)
    return {"path": path, "size": len(content), "data": base64.b64encode(content).decode()}
