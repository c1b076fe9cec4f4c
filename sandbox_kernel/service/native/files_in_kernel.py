"""The file operation that runs inside a session's kernel, sent there as source text.

`files.py` reads this file and runs it in the kernel with the `main()` convention, its entry
point `__sandbox_files__`; the service never imports it. Inside the kernel it can reach only what
the kernel's own code could, under its Landlock rules.
"""


def __sandbox_files__(op, path, data=None, limit=0):
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
    size = os.path.getsize(target)
    if size > limit:
        raise ValueError(f"{path} is {size} bytes, above the {limit}-byte limit")
    with open(target, "rb") as file:
        content = file.read(limit + 1)
    return {"path": path, "size": len(content), "data": base64.b64encode(content).decode()}
