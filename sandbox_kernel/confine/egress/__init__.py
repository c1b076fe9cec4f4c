"""The egress proxy: the only way out of a kernel's private network namespace.

rules.py decides (allowlist of names, address grants, the ranges never reached), tls.py reads
a ClientHello's server name, proxy.py serves HTTP CONNECT and plain HTTP on a listener made
inside the kernel's namespace, from the kernel's unconfined reaper, which lives outside it.
For a kernel with secrets (secret.py), intercept.py adds them on the way to their hosts over
TLS ended with the kernel's own CA (ca.py, made in the reaper), which the kernel trusts
(trust.py).
"""
