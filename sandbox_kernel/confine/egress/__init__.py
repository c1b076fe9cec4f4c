"""The egress proxy: the only way out of a kernel's private network namespace.

rules.py decides (allowlist of names, address grants, the ranges never reached), tls.py reads
a ClientHello's server name, proxy.py serves HTTP CONNECT and plain HTTP on a listener made
inside the kernel's namespace, from the kernel's unconfined reaper, which lives outside it.
"""
