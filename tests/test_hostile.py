"""The hostile-code suite: attacks run in real sandboxed kernels, each with its exact outcome.

Every case names what it attacks, the code, the secure outcome and the layer that stops it;
docs/SECURITY.md carries the same table (`python -m tests.test_hostile` prints it) and a test
keeps the two equal. Safety while testing: signals are probed with signal 0 only, every bomb is
bounded by count, size or time, and canaries live in a temporary directory this module owns.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyseccomp
import pytest

from sandbox_kernel.client import Sandbox
from sandbox_kernel.policy import SandboxPolicy
from tests.helpers import RAW_SYSCALL, evaluate, ok

EPERM, EACCES = (-1, errno.EPERM), ("PermissionError", errno.EACCES)
DENIED = ("PermissionError", errno.EPERM)
HIGH = 1 << 32  # set in a 64-bit register, dropped by the kernel from an int argument
CANARY_TEXT = "host data the sandbox must not touch"


def nr(name: str) -> int:
    """This architecture's number of a system call."""
    return pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)


@dataclass(frozen=True)
class Case:
    """One attack: its id, group, what it tries, code whose value is the outcome, and more."""

    id: str
    group: str
    attack: str
    code: str
    expect: Any
    layer: str
    kernel: str = "hostile"  # "hostile" (network off) or "net" (--allow-network)


# Code run once in each kernel: raw syscalls, an outcome catcher, and some handy values.
PRELUDE = RAW_SYSCALL + """
import os, ctypes, socket, threading
libc = ctypes.CDLL(None, use_errno=True)
PPID = os.getppid()
def trap(fn):
    try:
        fn()
        return "ok"
    except BaseException as exc:
        return (type(exc).__name__, getattr(exc, "errno", None))
def thread_value(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start(); t.join()
    return box[0]
def in_thread(fn):
    return thread_value(lambda: trap(fn))
def cstr(text):
    buf = ctypes.create_string_buffer(text.encode())
    _keep.append(buf)
    return ctypes.addressof(buf)
def sched_attr(policy, nice, priority=0, *deadline):  # struct sched_attr, for sched_setattr
    import struct  # deadline: runtime, deadline, period (ns), for SCHED_DEADLINE
    buf = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 56, policy, 0, nice, priority,
                                                  *(deadline or (0, 0, 0))), 56)
    _keep.append(buf)
    return ctypes.addressof(buf)
_keep = []
def thread_bomb(limit):
    stop, started = threading.Event(), []
    try:
        for _ in range(limit):
            t = threading.Thread(target=stop.wait, daemon=True)
            t.start()
            started.append(t)
        return "ok"
    except BaseException as exc:
        return (type(exc).__name__, getattr(exc, "errno", None))
    finally:
        stop.set()
        for t in started:
            t.join()
def raw_thread_bomb(limit):
    # pthread_create from C, around Python's threading: the bound must hold there too. Each
    # thread runs sleep(3) and ends, so the kernel has its threads back afterwards.
    sleep = ctypes.cast(libc.sleep, ctypes.c_void_p)
    attr = ctypes.create_string_buffer(64)  # pthread_attr_t: small stacks, as finding 7 used
    libc.pthread_attr_init(attr)
    libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(65536))
    started = 0
    for _ in range(limit):
        tid = ctypes.c_ulong()
        if libc.pthread_create(ctypes.byref(tid), attr, sleep, ctypes.c_void_p(3)) != 0:
            break
        libc.pthread_detach(tid)  # its stack is freed when it ends
        started += 1
    __import__('time').sleep(4)
    return "bounded" if started < 600 else started
def kernel_tcp_fds():
    fds = []
    for name in os.listdir('/proc/self/fd'):
        try:
            if os.readlink(f'/proc/self/fd/{name}').startswith('socket:'):
                probe = socket.socket(fileno=os.dup(int(name)))
                if probe.family == socket.AF_INET:
                    fds.append(int(name))
                probe.close()
        except OSError:
            pass
    return fds
def children():
    pid = os.getpid()
    return [int(c) for c in open(f'/proc/{pid}/task/{pid}/children').read().split()]
def descriptor_bomb(limit):
    fds = []
    try:
        return trap(lambda: [fds.append(os.open('/dev/null', os.O_RDONLY)) for _ in range(limit)])
    finally:
        for fd in fds:
            os.close(fd)
def many_files(count):
    # Empty files until the scratch refuses one: the errno, if it refused at its inode bound.
    bound, made = os.statvfs('.').f_files, []
    try:
        for i in range(count):
            open(f'empty-{i}', 'w').close()
            made.append(i)
        return ("unbounded", len(made))
    except OSError as exc:
        at_bound = bound - 64 <= len(made) <= bound
        return (type(exc).__name__, exc.errno) if at_bound else ("early", len(made), bound)
    finally:
        for i in made:
            os.unlink(f'empty-{i}')
def lock_host_file(operation):
    fd = os.open(os.__file__, os.O_RDONLY)  # the stdlib: readable, and the host's
    try:
        return trap(lambda: __import__('fcntl').flock(fd, operation))
    finally:
        os.close(fd)
def fill_scratch(megabytes):
    try:
        return trap(lambda: [open(f'fill-{i}', 'wb').write(bytes(2**20)) for i in range(megabytes)])
    finally:
        for name in os.listdir('.'):
            if name.startswith('fill-'):
                os.unlink(name)
"""

AF_VSOCK, AF_ALG = 40, 38
CLONE_THREAD_FLAGS = 0x10000 | 0x100 | 0x800  # CLONE_THREAD | CLONE_VM | CLONE_SIGHAND

CASES = [
    # --- process creation ---
    Case("P01", "process", "subprocess.run", "trap(lambda: __import__('subprocess').run(['true']))",
         DENIED, "seccomp: clone without CLONE_THREAD"),
    Case("P02", "process", "os.system", "trap(lambda: os.system('true'))", DENIED,
         "seccomp: clone"),
    Case("P03", "process", "os.fork", "trap(os.fork)", DENIED, "seccomp: clone"),
    Case("P04", "process", "os.posix_spawn",
         "trap(lambda: os.posix_spawn('/bin/true', ['true'], {}))", DENIED,
         "seccomp: clone3 ENOSYS, then clone"),
    Case("P05", "process", "os.execv replaces the image",
         "trap(lambda: os.execv('/bin/sh', ['sh']))", DENIED, "seccomp: execve"),
    Case("P06", "process", "pty.fork (IPython's !cmd)", "trap(lambda: __import__('pty').fork())",
         DENIED, "Landlock: /dev/ptmx; seccomp: clone"),
    Case("P07", "process", "multiprocessing, fork context",
         "trap(lambda: __import__('multiprocessing').get_context('fork')"
         ".Process(target=print).start())", DENIED, "seccomp: clone"),
    Case("P08", "process", "libc fork() through ctypes",
         "(libc.fork(), ctypes.get_errno())", (-1, errno.EPERM), "seccomp: clone"),
    Case("P09", "process", "libc execv() through ctypes",
         "(libc.execv(b'/bin/sh', None), ctypes.get_errno())", (-1, errno.EPERM),
         "seccomp: execve"),
    Case("P10", "process", "raw fork", f"raw({nr('fork')})", EPERM, "seccomp"),
    Case("P11", "process", "raw vfork", f"raw({nr('vfork')})", EPERM, "seccomp"),
    Case("P12", "process", "raw clone(SIGCHLD)",
         f"raw({nr('clone')}, {signal.SIGCHLD}, 0, 0, 0, 0)",
         EPERM, "seccomp: CLONE_THREAD required"),
    Case("P13", "process", "raw clone with high bits set in flags",
         f"raw({nr('clone')}, {signal.SIGCHLD | HIGH}, 0, 0, 0, 0)", EPERM,
         "seccomp: compares the kernel's 32 bits"),
    Case("P14", "process", "a 'thread' in a new user namespace",
         f"raw({nr('clone')}, {CLONE_THREAD_FLAGS | 0x10000000}, 0, 0, 0, 0)", EPERM,
         "seccomp: namespace flags"),
    Case("P15", "process", "raw clone3", f"raw({nr('clone3')}, 0, 0)", (-1, errno.ENOSYS),
         "seccomp: ENOSYS so libc falls back to clone"),
    Case("P16", "process", "raw execveat",
         f"raw({nr('execveat')}, -100, cstr('/bin/true'), 0, 0, 0)", EPERM, "seccomp"),
    Case("P17", "process", "memfd-based exec: memfd_create",
         f"raw({nr('memfd_create')}, cstr('x'), 0)", EPERM, "seccomp"),
    Case("P18", "process", "exec of an open file (execveat AT_EMPTY_PATH)",
         f"raw({nr('execveat')}, os.open('/bin/true', os.O_RDONLY), cstr(''), 0, 0, 0x1000)",
         EPERM, "seccomp"),
    Case("P19", "process", "fork from another thread", "in_thread(os.fork)", DENIED,
         "seccomp (TSYNC: every thread)"),
    Case("P20", "process", "exec a setuid-root binary to gain root's capabilities",
         "trap(lambda: os.execv('/usr/bin/su', ['su', '-c', 'id']))", DENIED,
         "seccomp: execve; the empty bounding set besides (test_privileges)"),
    # --- network ---
    Case("N17", "network", "connect out through one of the kernel's own TCP sockets",
         "sorted({trap(lambda: socket.socket(fileno=os.dup(fd)).connect(('127.0.0.1', {port})))"
         " for fd in kernel_tcp_fds()})", [DENIED],
         "seccomp: no connect without the network (Landlock TCP connect too from ABI 4)"),
    Case("N01", "network", "socket.socket()", "trap(lambda: __import__('socket').socket())",
         DENIED, "seccomp: socket"),
    Case("N02", "network", "UDP over IPv6",
         "trap(lambda: __import__('socket').socket(socket.AF_INET6, socket.SOCK_DGRAM))",
         DENIED, "seccomp: socket"),
    Case("N03", "network", "AF_UNIX socket to a host service",
         "trap(lambda: __import__('socket').socket(socket.AF_UNIX))", DENIED, "seccomp: socket"),
    Case("N04", "network", "raw netlink socket", f"raw({nr('socket')}, 16, 3, 0)", EPERM,
         "seccomp"),
    Case("N05", "network", "raw packet socket", f"raw({nr('socket')}, 17, 3, 768)", EPERM,
         "seccomp"),
    Case("N06", "network", "vsock", f"raw({nr('socket')}, {AF_VSOCK}, 1, 0)", EPERM, "seccomp"),
    Case("N07", "network", "AF_ALG crypto socket", f"raw({nr('socket')}, {AF_ALG}, 5, 0)", EPERM,
         "seccomp"),
    Case("N08", "network", "AF_INET with high bits set",
         f"raw({nr('socket')}, {socket.AF_INET | HIGH}, 1, 0)", EPERM,
         "seccomp: masked comparison"),
    Case("N09", "network", "HTTP to a server listening on loopback",
         "trap(lambda: __import__('urllib.request').request.urlopen("
         "'http://127.0.0.1:{port}/', timeout=5))", ("URLError", None), "seccomp: socket"),
    Case("N10", "network", "read the Jupyter server's token file",
         "trap(lambda: open('{runtime}/jpserver-424242.json').read())", EACCES, "Landlock"),
    Case("N11", "network", "a token in the launching environment",
         "'JUPYTER_TOKEN' in os.environ or b'JUPYTER_TOKEN' in open('/proc/self/environ', 'rb')"
         ".read()", False, "clean exec"),
    Case("N12", "network", "with --allow-network: HTTP to the loopback server",
         "trap(lambda: __import__('urllib.request').request.urlopen('http://127.0.0.1:{port}/', "
         "timeout=5).read())", ("HTTPError", None),
         "network namespace + egress proxy: loopback refused (403 names --allow-address)",
         kernel="net"),
    Case("N26", "network", "with --allow-network: HTTP to the cloud metadata address",
         "trap(lambda: __import__('urllib.request').request.urlopen("
         "'http://169.254.169.254/latest/meta-data/', timeout=5).read())", ("HTTPError", None),
         "egress proxy: link-local refused", kernel="net"),
    Case("N27", "network", "with --allow-network: TCP straight to another kernel's shell port",
         "trap(lambda: socket.create_connection(('127.0.0.1', {other_shell_port}), timeout=5))",
         ("ConnectionRefusedError", errno.ECONNREFUSED),
         "network namespace: its loopback is the kernel's own", kernel="net"),
    Case("N28", "network", "with --allow-network: another kernel's port through the proxy",
         "trap(lambda: __import__('urllib.request').request.urlopen("
         "'http://localhost:{other_shell_port}/', timeout=5).read())", ("HTTPError", None),
         "egress proxy: loopback refused", kernel="net"),
    Case("N29", "network", "with --allow-network: UDP datagram to an outside address",
         "trap(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
         "('192.0.2.1', 53)))", ("OSError", errno.ENETUNREACH),
         "network namespace: no route but the proxy's", kernel="net"),
    Case("N30", "network", "with --allow-network: list the host's listeners in /proc/net/tcp",
         "sorted(line.split()[1] for line in open('/proc/net/tcp').read().splitlines()[1:] "
         "if line.split()[3] == '0A')", ["0100007F:0C38"],
         "network namespace: only the egress listener is there", kernel="net"),
    Case("N13", "network", "with --allow-network: listen on a TCP port",
         "trap(lambda: __import__('socket').create_server(('127.0.0.1', 0)))", DENIED,
         "seccomp: bind (Landlock: bind only on the kernel's ports)", kernel="net"),
    Case("N18", "network", "with --allow-network: listen on the kernel's own port at 127.0.0.2",
         "trap(lambda: socket.create_server(('127.0.0.2', "
         "socket.socket(fileno=os.dup(kernel_tcp_fds()[0])).getsockname()[1])))", DENIED,
         "seccomp: bind (Landlock's port rule ignores the address)", kernel="net"),
    Case("N19", "network", "with --allow-network: UDP server on any port",
         "trap(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).bind(('0.0.0.0', 0)))",
         DENIED, "seccomp: bind (Landlock has no UDP rule)", kernel="net"),
    Case("N20", "network", "with --allow-network: listen() on a dup of the kernel's listener",
         f"raw({nr('listen')}, os.dup(kernel_tcp_fds()[0]), 1)", EPERM, "seccomp: listen",
         kernel="net"),
    Case("N21", "network", "unix datagram socketpair, then sendto a host socket (/dev/log)",
         "trap(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM))", DENIED,
         "seccomp: socketpair SOCK_STREAM only"),
    Case("N22", "network", "raw socketpair SOCK_DGRAM with high bits and flags",
         f"raw({nr('socketpair')}, 1, {socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | HIGH}, 0, "
         "cstr('x' * 8))", EPERM, "seccomp: masked comparison"),
    Case("N23", "network", "unix seqpacket socketpair",
         "trap(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))", DENIED,
         "seccomp: socketpair SOCK_STREAM only"),
    Case("N24", "network", "sendto a pathname socket through a stream socketpair",
         "trap(lambda: socket.socketpair()[0].sendto(b'<11>forged', '{unix_socket}'))",
         ("OSError", errno.EISCONN), "Linux: a connected stream socket takes no address"),
    Case("N25", "network", "bind a socketpair to a pathname (a server in scratch)",
         "trap(lambda: socket.socketpair()[0].bind('srv'))", DENIED, "seccomp: bind"),
    Case("N14", "network", "with --allow-network: AF_UNIX socket",
         "trap(lambda: __import__('socket').socket(socket.AF_UNIX))", DENIED, "seccomp",
         kernel="net"),
    Case("N15", "network", "with --allow-network: raw IP socket",
         f"raw({nr('socket')}, 2, 3, 1)", EPERM, "seccomp: stream/dgram only", kernel="net"),
    Case("N16", "network", "with --allow-network: netlink",
         f"raw({nr('socket')}, 16, 3, 0)", EPERM, "seccomp", kernel="net"),
    # --- file system ---
    Case("F01", "files", "read a secret in the real HOME",
         "trap(lambda: open('{home}/secret.txt').read())", EACCES, "Landlock"),
    Case("F02", "files", "list the Jupyter runtime dir", "trap(lambda: os.listdir('{runtime}'))",
         EACCES, "Landlock"),
    Case("F03", "files", "read another kernel's connection file",
         "trap(lambda: open('{other_connection_file}').read())", EACCES, "Landlock"),
    Case("F04", "files", "read /etc/shadow", "trap(lambda: open('/etc/shadow').read())", EACCES,
         "Landlock"),
    Case("F23", "files", "list the TLS private keys (/etc/ssl/private, via /usr/lib/ssl)",
         "trap(lambda: os.listdir('/usr/lib/ssl/private'))", EACCES, "Landlock: only certs"),
    Case("F24", "files", "TLS verification still works (the CA bundle is readable)",
         "__import__('ssl').create_default_context().cert_store_stats()['x509_ca'] > 0", True,
         "allowed: /etc/ssl/certs"),
    Case("F25", "files", "escape through the own /proc/self/root magic link",
         "trap(lambda: open('/proc/self/root/etc/shadow').read())", EACCES, "Landlock"),
    Case("F26", "files", "list the scratch's parent (other kernels' scratch)",
         "trap(lambda: os.listdir('/proc/self/cwd/..'))", EACCES, "Landlock"),
    Case("F05", "files", "overwrite a host file", "trap(lambda: open('{canary}', 'w'))", EACCES,
         "Landlock"),
    Case("F06", "files", "truncate a host file", "trap(lambda: os.truncate('{canary}', 0))",
         EACCES, "Landlock"),
    Case("F07", "files", "delete a host file", "trap(lambda: os.unlink('{canary}'))", EACCES,
         "Landlock"),
    # Landlock answers EXDEV when a file would move across its rules without REFER rights.
    Case("F08", "files", "rename a host file into scratch",
         "trap(lambda: os.rename('{canary}', 'stolen'))", ("OSError", errno.EXDEV), "Landlock"),
    Case("F09", "files", "hard-link a host file into scratch",
         "trap(lambda: os.link('{canary}', 'linked'))", ("OSError", errno.EXDEV), "Landlock"),
    Case("F10", "files", "write through a symlink made in scratch",
         "(os.symlink('{canary}', 'via-link'), trap(lambda: open('via-link', 'w')))[1]", EACCES,
         "Landlock"),
    Case("F11", "files", "chmod a host file", "trap(lambda: os.chmod('{canary}', 0o777))",
         DENIED, "seccomp: chmod family"),
    Case("F12", "files", "chown a host file", "trap(lambda: os.chown('{canary}', 0, 0))", DENIED,
         "seccomp"),
    Case("F13", "files", "set an extended attribute",
         "trap(lambda: os.setxattr('{canary}', 'user.x', b'1'))", DENIED, "seccomp"),
    Case("F14", "files", "plant a .pth file in site-packages",
         "trap(lambda: open(__import__('sysconfig').get_paths()['purelib'] + '/evil.pth', 'w'))",
         EACCES, "Landlock"),
    Case("F15", "files", "plant sitecustomize.py in the stdlib",
         "trap(lambda: open(os.path.dirname(os.__file__) + '/sitecustomize.py', 'w'))", EACCES,
         "Landlock"),
    Case("F16", "files", "make a device node", "trap(lambda: os.mknod('disk', 0o600 | 0o60000,"
         " os.makedev(254, 0)))", DENIED, "seccomp: mknod"),
    Case("F17", "files", "read a block device", "trap(lambda: open('/dev/vda', 'rb'))", EACCES,
         "Landlock"),
    Case("F18", "files", "read the kernel log device", "trap(lambda: open('/dev/kmsg'))", EACCES,
         "Landlock"),
    Case("F19", "files", "one file past --file-size-limit",
         "trap(lambda: open('big.bin', 'wb').write(bytes(5 * 2**20)))", ("OSError", errno.EFBIG),
         "rlimit FSIZE"),
    Case("F20", "files", "write into /dev/shm", "trap(lambda: open('/dev/shm/x', 'w'))", EACCES,
         "Landlock"),
    Case("F21", "files", "write a kernel tunable in /proc/sys",
         "trap(lambda: open('/proc/sys/kernel/hostname', 'w'))", EACCES, "Landlock"),
    Case("F22", "files", "write outside scratch from another thread",
         "in_thread(lambda: open('{canary}', 'a'))", EACCES, "Landlock (before any thread)"),
    # --- privilege and other processes ---
    Case("X01", "processes", "signal the parent (signal 0)", "trap(lambda: os.kill(PPID, 0))",
         DENIED, "seccomp: kill own pid only; Landlock signal scope"),
    Case("X02", "processes", "signal every process (-1, signal 0)",
         f"raw({nr('kill')}, {2**64 - 1}, 0)", EPERM, "seccomp"),
    Case("X03", "processes", "signal the own process group", f"raw({nr('kill')}, 0, 0)", EPERM,
         "seccomp"),
    Case("X04", "processes", "signal the parent, pid with high bits",
         f"raw({nr('kill')}, PPID | {HIGH}, 0)", EPERM, "seccomp: masked comparison"),
    Case("X05", "processes", "killpg", "trap(lambda: os.killpg(os.getpgrp(), 0))", DENIED,
         "seccomp"),
    Case("X06", "processes", "tgkill the parent", f"raw({nr('tgkill')}, PPID, PPID, 0)", EPERM,
         "seccomp"),
    Case("X07", "processes", "ptrace attach to the parent", f"raw({nr('ptrace')}, 16, PPID, 0, 0)",
         EPERM, "seccomp"),
    Case("X08", "processes", "read the parent's memory (process_vm_readv)",
         f"raw({nr('process_vm_readv')}, PPID, 0, 0, 0, 0, 0)", EPERM, "seccomp"),
    Case("X09", "processes", "open the parent's /proc/pid/mem",
         "trap(lambda: open(f'/proc/{PPID}/mem', 'rb'))", EACCES, "Landlock"),
    Case("X10", "processes", "read the parent's environment",
         "trap(lambda: open(f'/proc/{PPID}/environ').read())", EACCES, "Landlock"),
    Case("X11", "processes", "read init's command line",
         "trap(lambda: open('/proc/1/cmdline').read())", EACCES, "Landlock"),
    Case("X12", "processes", "change the parent's limits (prlimit64)",
         f"raw({nr('prlimit64')}, PPID, 7, cstr('x' * 16), 0)", EPERM, "seccomp"),
    Case("X13", "processes", "renice the parent", f"raw({nr('setpriority')}, 0, PPID, 19)",
         EPERM, "seccomp"),
    Case("X14", "processes", "pin the parent to a CPU",
         f"raw({nr('sched_setaffinity')}, PPID, 8, cstr('\\x01' * 8))", EPERM, "seccomp"),
    Case("X20", "processes", "make the parent idle-priority (SCHED_IDLE)",
         "trap(lambda: os.sched_setscheduler(PPID, os.SCHED_IDLE, os.sched_param(0)))", DENIED,
         "seccomp: only SCHED_OTHER for other ids"),
    Case("X21", "processes", "signal the scratch reaper (the kernel's own child)",
         "[trap(lambda: os.kill(child, 0)) for child in children()]", [DENIED],
         "seccomp: own pid only"),
    Case("X15", "processes", "setuid(0)", f"raw({nr('setuid')}, 0)", EPERM, "seccomp"),
    Case("X16", "processes", "raise the own memory limit",
         "trap(lambda: __import__('resource').setrlimit(__import__('resource').RLIMIT_DATA, "
         "(-1, -1)))", ("ValueError", None), "seccomp: prlimit64 read-only"),
    Case("X17", "processes", "pidfd of the parent", f"raw({nr('pidfd_open')}, PPID, 0)", EPERM,
         "seccomp"),
    Case("X18", "processes", "signal the parent from another thread",
         "in_thread(lambda: os.kill(PPID, 0))", DENIED, "seccomp (TSYNC)"),
    Case("X19", "processes", "capabilities left to use",
         "[l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm'))]",
         ["0000000000000000"] * 2, "privilege drop"),
    # --- kernel attack surface ---
    Case("K01", "kernel", "io_uring", f"raw({nr('io_uring_setup')}, 8, cstr('x' * 120))", EPERM,
         "seccomp"),
    Case("K22", "kernel", "flock(LOCK_EX) on a readable host file (the stdlib's os.py)",
         "lock_host_file(2)", DENIED, "seccomp: flock LOCK_UN only"),
    Case("K23", "kernel", "flock(LOCK_SH | LOCK_NB) on a readable host file",
         "lock_host_file(1 | 4)", DENIED, "seccomp: flock LOCK_UN only"),
    Case("K24", "kernel", "raw flock(LOCK_EX) with high bits set",
         f"raw({nr('flock')}, 0, {HIGH} | 2)", EPERM, "seccomp: flock LOCK_UN only"),
    Case("K25", "kernel", "syncfs: write back the host's file system",
         f"raw({nr('syncfs')}, 0)", EPERM, "seccomp"),
    Case("K26", "kernel", "sync: write back every file system", f"raw({nr('sync')})", EPERM,
         "seccomp"),
    Case("K02", "kernel", "bpf", f"raw({nr('bpf')}, 0, 0, 0)", EPERM, "seccomp"),
    Case("K03", "kernel", "userfaultfd", f"raw({nr('userfaultfd')}, 0)", EPERM, "seccomp"),
    Case("K04", "kernel", "perf_event_open", f"raw({nr('perf_event_open')}, 0, 0, -1, -1, 0)",
         EPERM, "seccomp"),
    Case("K05", "kernel", "keyrings (add_key)", f"raw({nr('add_key')}, 0, 0, 0, 0, 0)", EPERM,
         "seccomp"),
    Case("K06", "kernel", "new user namespace", f"raw({nr('unshare')}, 0x10000000)", EPERM,
         "seccomp"),
    Case("K07", "kernel", "join a namespace", f"raw({nr('setns')}, 0, 0)", EPERM, "seccomp"),
    Case("K08", "kernel", "mount",
         f"raw({nr('mount')}, cstr('none'), cstr('.'), cstr('tmpfs'), 0, 0)",
         EPERM, "seccomp"),
    Case("K09", "kernel", "personality(ADDR_NO_RANDOMIZE)", f"raw({nr('personality')}, 0x40000)",
         EPERM, "seccomp: query only"),
    Case("K10", "kernel", "kexec_load", f"raw({nr('kexec_load')}, 0, 0, 0, 0)", EPERM, "seccomp"),
    Case("K11", "kernel", "load a module", f"raw({nr('init_module')}, 0, 0, 0)", EPERM, "seccomp"),
    Case("K12", "kernel", "open_by_handle_at", f"raw({nr('open_by_handle_at')}, 0, 0, 0)", EPERM,
         "seccomp"),
    Case("K13", "kernel", "unknown syscall number 1000", "raw(1000)", EPERM,
         "seccomp: default deny"),
    Case("K14", "kernel", "TIOCSTI keystroke injection", f"raw({nr('ioctl')}, 0, 0x5412, 0)",
         EPERM, "seccomp"),
    Case("K15", "kernel", "TIOCSTI with high bits set",
         f"raw({nr('ioctl')}, 0, {0x5412 | HIGH}, 0)",
         EPERM, "seccomp: masked comparison"),
    Case("K16", "kernel", "modify_ldt", f"raw({nr('modify_ldt')}, 0, 0, 0)", EPERM, "seccomp"),
    Case("K17", "kernel", "stack an own seccomp filter", f"raw({nr('seccomp')}, 1, 0, 0)", EPERM,
         "seccomp"),
    Case("K18", "kernel", "prctl(PR_SET_SECCOMP)", f"raw({nr('prctl')}, 22, 2, 0, 0, 0)", EPERM,
         "seccomp: prctl allowlist"),
    Case("K19", "kernel", "read the kernel log (syslog)", f"raw({nr('syslog')}, 3, 0, 0)", EPERM,
         "seccomp"),
    # --- resource exhaustion ---
    Case("R01", "resources", "one huge allocation", "trap(lambda: bytearray(2**30))",
         ("MemoryError", None), "rlimit DATA"),
    Case("R02", "resources", "a huge numpy array",
         "trap(lambda: __import__('numpy').ones(200_000_000))", ("MemoryError", None),
         "rlimit DATA"),
    Case("R03", "resources", "many small allocations",
         "trap(lambda: [bytes(2**20) for _ in range(1000)])", ("MemoryError", None),
         "rlimit DATA"),
    Case("R04", "resources", "shared anonymous memory (not counted by RLIMIT_DATA)",
         "trap(lambda: __import__('mmap').mmap(-1, 2**30))", DENIED, "seccomp: mmap MAP_SHARED"),
    Case("R05", "resources", "thread bomb, 32 KiB stacks (bounded at 3000)",
         "(threading.stack_size(32768), thread_bomb(3000), threading.stack_size(0))[1]",
         ("RuntimeError", None), "rlimit NPROC (--max-threads, default 512)"),
    Case("R11", "resources", "MAP_GROWSDOWN mappings (stack, not data, to RLIMIT_DATA)",
         "trap(lambda: __import__('mmap').mmap(-1, 2**20, flags=0x100 | 0x22))", DENIED,
         "seccomp: mmap MAP_GROWSDOWN"),
    Case("R12", "resources", "MAP_GROWSDOWN through raw mmap, high bits set",
         f"raw({nr('mmap')}, 0, 2**20, 3, {0x100 | 0x22 | HIGH}, 2**64 - 1, 0)", EPERM,
         "seccomp: masked comparison"),
    Case("R14", "resources", "mremap the stack's lowest page into a 64 MiB stack mapping",
         f"raw({nr('mremap')}, int(next(l for l in open('/proc/self/maps')"
         " if l.rstrip().endswith('[stack]')).split('-')[0], 16), 4096, 64 << 20, 1, 0)", EPERM,
         "seccomp: mremap"),
    # 40 MiB: above glibc's largest mmap threshold, so realloc would use mremap. In the other
    # kernel: the memory bombs above leave this one's heap near its limit.
    Case("R15", "resources", "realloc of a large block still works without mremap",
         "(lambda b: (b.extend(bytes(40 << 20)), len(b))[1])(bytearray(40 << 20))", 80 << 20,
         "allowed: glibc's realloc copies", kernel="net"),
    Case("R13", "resources", "threads started raw (pthread_create), past the bound",
         "raw_thread_bomb(3000)", "bounded", "rlimit NPROC"),
    Case("R06", "resources", "descriptor bomb (bounded at 5000)", "descriptor_bomb(5000)",
         ("OSError", errno.EMFILE), "rlimit NOFILE"),
    Case("R07", "resources", "fill the scratch with many files (bounded at 100 MiB)",
         "fill_scratch(100)", ("OSError", errno.ENOSPC), "scratch tmpfs quota (root)"),
    Case("R16", "resources", "300,000 empty files in the scratch (inodes: host kernel memory)",
         "many_files(300_000)", ("OSError", errno.ENOSPC),
         "scratch tmpfs nr_inodes (--scratch-files, root)"),
    Case("R18", "resources", "take back the CPU priority the kernel gave up (setpriority)",
         "trap(lambda: os.setpriority(os.PRIO_PROCESS, 0, 0))", EACCES,
         "RLIMIT_NICE 0 (--nice, default 5)"),
    Case("R19", "resources", "the same from a thread of its own",
         "in_thread(lambda: os.setpriority(os.PRIO_PROCESS, 0, 0))", EACCES, "RLIMIT_NICE 0"),
    Case("R20", "resources", "a lower nice value through sched_setattr",
         f"raw({nr('sched_setattr')}, 0, sched_attr(0, -20), 0)", EPERM, "RLIMIT_NICE 0"),
    Case("R21", "resources", "a real-time policy through sched_setattr (seccomp cannot read it)",
         f"raw({nr('sched_setattr')}, 0, sched_attr(1, 0, 1), 0)", EPERM, "RLIMIT_RTPRIO 0"),
    Case("R22", "resources", "SCHED_RR through sched_setattr, from a thread of its own",
         f"thread_value(lambda: raw({nr('sched_setattr')}, 0, sched_attr(2, 0, 1), 0))", EPERM,
         "RLIMIT_RTPRIO 0"),
    Case("R23", "resources", "SCHED_DEADLINE through sched_setattr (no rlimit, root only)",
         f"raw({nr('sched_setattr')}, 0, sched_attr(6, 0, 0, 10**6, 10**7, 10**7), 0)", EPERM,
         "no CAP_SYS_NICE"),
    # --- information leaks ---
    Case("I01", "leaks", "a secret in the launching environment", "'HOSTILE_SECRET' in os.environ",
         False, "clean exec"),
    Case("I02", "leaks", "the same secret in /proc/self/environ",
         "b'HOSTILE_SECRET' in open('/proc/self/environ', 'rb').read()", False, "clean exec"),
    Case("I03", "leaks", "the parent's command line",
         "trap(lambda: open(f'/proc/{PPID}/cmdline').read())", EACCES, "Landlock"),
    Case("I04", "leaks", "init's environment", "trap(lambda: open('/proc/1/environ').read())",
         EACCES, "Landlock"),
    Case("I05", "leaks", "the user's Jupyter config", "trap(lambda: os.listdir('{config}'))",
         EACCES, "Landlock"),
    Case("I06", "leaks", "cgroup files", "trap(lambda: os.listdir('/sys/fs/cgroup'))", EACCES,
         "Landlock"),
    Case("I07", "leaks", "descriptors open to files outside the sandbox",
         "[t for t in (os.readlink(f'/proc/self/fd/{n}') for n in os.listdir('/proc/self/fd')"
         " if os.path.exists(f'/proc/self/fd/{n}')) if t.startswith('{tmp}')]", [],
         "clean exec closes inherited descriptors"),
    Case("I08", "leaks", "inotify watch on a directory Landlock forbids",
         "(libc.inotify_init(), ctypes.get_errno())", EPERM, "seccomp: inotify_init"),
    Case("I09", "leaks", "raw inotify_init1 and inotify_add_watch",
         f"sorted({{raw({nr('inotify_init1')}, 0), raw({nr('inotify_add_watch')}, 0, "
         "cstr('/root'), 0xfff)})", [EPERM], "seccomp: inotify"),
    Case("I10", "leaks", "fanotify", f"raw({nr('fanotify_init')}, 0, 0)", EPERM, "seccomp"),
    Case("I11", "leaks", "dnotify (fcntl F_NOTIFY) on the scratch", f"raw({nr('fcntl')}, "
         "os.open('.', os.O_RDONLY), 1026, 0x80000003)", EPERM, "seccomp: fcntl allowlist"),
]

# Cases that end or hang the kernel: each has its own test below (and a row in SECURITY.md).
SPECIAL = [
    Case("K20", "kernel", "x32 ABI syscall", "raw(0x40000000 | 39)", "killed by SIGSYS",
         "seccomp: foreign ABI kills"),
    Case("K21", "kernel", "i386 entry point (int 0x80)", "int 0x80 from an executable page",
         "killed by SIGSYS", "seccomp: foreign arch kills"),
    Case("X22", "processes", "SIGIO/F_SETSIG to another process: F_SETOWN, F_SETOWN_EX, "
         "FIOSETOWN, SIOCSPGRP, pgid, high bits, threads (tests/test_abi.py, ABI 1-7)",
         "fcntl(a, F_SETOWN, victim)", "PermissionError (EPERM); victim alive",
         "seccomp: owner only this process (Landlock signal scope too from ABI 6)"),
    Case("N26", "network", "reconnect a dup of a kernel TCP socket: connect(AF_UNSPEC), "
         "connect, sendto MSG_FASTOPEN (tests/test_abi.py, ABI 1-7)", "connect(dup(fd), ...)",
         "-1, EPERM; kernel alive", "seccomp: no connect without the network"),
    Case("F27", "files", "truncate a file the uid owns: truncate(path), open(O_RDONLY|O_TRUNC), "
         "openat2, threads (tests/test_abi.py, ABI 1-7)", "os.truncate(path, 0)",
         "EPERM (ABI < 3) / EACCES (ABI >= 3)",
         "seccomp below ABI 3; Landlock truncate from ABI 3"),
    Case("I12", "leaks", "scan all readable memory (/proc/self/mem) and every /proc/self file for "
         "a secret of the launcher: fork-served, cold, pooled, service (dify and native API), "
         "eg-launch (tests/test_secrets.py)", "mem.seek(start); mem.read(size)", "not found",
         "environment filtered before it is sent; the fork server never reads a request"),
    Case("E01", "privilege", "--env LD_PRELOAD=<a library in a shared --write-path>, so the "
         "next kernel's unconfined start-up loads it as root (tests/test_privileges.py)",
         "--env LD_PRELOAD=/shared/x.so", "refused to start (--allow-loader-env); with it, "
         "set once confined, never loaded", "environment: --env applied after confinement"),
    Case("X23", "processes", "another tenant's kernel sends {\"signum\": 9} (or 15, or shutdown) "
         "to an eg-launch comm port (tests/test_enterprise_gateway_launcher.py)",
         "connect(comm_port); send('{\"signum\": 9}')", "refused and logged; kernel alive",
         "comm-port listener: only the gateway's address, only EG's signals"),
    Case("X24", "processes", "a kernel leaves a 0600 file in a shared --write-path (1777); the "
         "next kernel gets its freed uid (tests/test_identity.py)",
         "open(left), open(left, 'a'), os.unlink(left)", "PermissionError x3 (another uid)",
         "identity: a uid stays out of use while it owns files in a write grant"),
    Case("F28", "files", "user code with a write grant puts a symlink to a secret's folder where "
         "a --read-path of the next kernel (ZMQ or one-shot) was (tests/test_grant_links.py)",
         "os.rmdir(grant); os.symlink(secret_dir, grant)", "next kernel refuses to start; "
         "secret never read", "grants name real paths: checked at start and on the Landlock "
         "rule's open file"),
    Case("F29", "files", "read a secret outside a --read-path folder through symlinks in it: "
         "absolute, relative, to a folder (tests/test_grant_links.py)", "open(grant + '/link')",
         "PermissionError (EACCES) x4", "Landlock: checks the link's target"),
    Case("X25", "processes", "hostile KERNEL_* values (a Jinja expression in KERNEL_POD_NAME, "
         "quote and newline breaks, a second document, U+2028/U+0085) rendered by EG 3.3.0's own "
         "launch_kubernetes.py (tests/test_enterprise_gateway_kernelspec.py)",
         "KERNEL_POD_NAME={{ 7 * 7 }}", "one Pod, each value plain data, confinement the "
         "install's", "pod template: yaml_safe on every KERNEL_* value"),
    Case("X26", "processes", "hostile KERNEL_ID, PORT_RANGE, KERNEL_SPARK_CONTEXT_INIT_MODE, "
         "RESPONSE_ADDRESS to eg-launch (tests/test_enterprise_gateway_launcher.py)",
         "KERNEL_ID=../../etc/cron.d/x", "exit 2, one line naming the value",
         "eg-launch: strict parsing before anything is written"),
    # The tool bridge (docs/tools.md): each case is the named tests' own, on both transports.
    Case("T01", "tools", "a tool request forged with a made-up parent (not the run's "
         "execute_request) "
         "(tests/test_tools_hostile.py::"
         "test_a_request_with_a_parent_other_than_the_run_is_dropped)",
         "forge(request, parent={'header': {'msg_id': 'an-earlier-run'}})", "dropped "
         "unanswered; nothing runs", "caller: serves only the run's own requests, dropped "
         "before parsing"),
    Case("T02", "tools", "a tool request over the caller's argument cap (forged past the "
         "kernel's check), or over what its connection takes "
         "(tests/test_tools_hostile.py::test_an_oversized_request_is_refused_before_it_is_parsed, "
         "tests/test_tools.py::"
         "test_a_call_larger_than_the_callers_message_cap_fails_in_the_kernel_at_once, "
         "tests/test_tools_hostile.py::"
         "test_a_request_forged_past_the_callers_message_cap_harms_neither_side)",
         "forge({'tool': 'search', 'args': ['x' * 20000]})", "refused before parsing; over the "
         "connection's cap refused in the kernel at once, or (forged) by the connection, and "
         "the next run's tools work", "caller: size checked before parsing; the grant's "
         "max_args within the connection's cap; a refused stdin connection made again"),
    Case("T03", "tools", "malformed tool requests (args not a list, content not an object, an "
         "object-like dict) "
         "(tests/test_tools_hostile.py::"
         "test_malformed_requests_are_refused_and_arguments_stay_data)",
         "forge({'tool': 'search', 'args': 'x', 'kwargs': {}})", "refused; a dict stays a dict",
         "caller: request shape checked, arguments only JSON data"),
    Case("T04", "tools", "a tool request replayed under the same call id "
         "(tests/test_tools_hostile.py::test_a_replayed_request_runs_once)", "forge(request, "
         "msg_id=earlier_id)", "the tool runs once; the replay refused", "caller: call ids used "
         "once per run"),
    Case("T05", "tools", "a flood of 300 tool requests against a budget of 5 "
         "(tests/test_tools_hostile.py::test_a_flood_of_requests_spends_the_budget_and_no_more)",
         "[forge(request) for n in range(300)]", "5 run, 295 refused; 69 records kept",
         "caller: the run's call budget, a bounded audit"),
    Case("T06", "tools", "a tool call after its run ended: a kept stub, a request under the "
         "ended run's parent (tests/test_tools.py::test_a_stub_kept_past_its_run_refuses, "
         "tests/test_tools_hostile.py::test_a_request_forged_for_a_run_that_has_ended_is_dropped)",
         "kept('x'); forge(request, parent=ended_run)", "ToolRefused; the request dropped, "
         "nothing runs", "kernel: stubs refuse once their run ends; caller: ended runs are "
         "served no more"),
    Case("T07", "tools", "two tool calls racing from two threads, answered out of order "
         "(tests/test_tools.py::test_concurrent_calls_are_answered_in_any_order)",
         "Thread(target=first).start(); second()", "each gets its own answer", "kernel: replies "
         "matched by call id"),
    Case("T08", "tools", "call a tool the sandbox has but this run did not grant "
         "(tests/test_tools_hostile.py::"
         "test_a_tool_outside_the_runs_grant_is_refused_and_never_runs, "
         "tests/test_tools.py::test_a_tool_not_granted_raises_with_the_names_that_were)",
         "forge({'tool': 'secret', 'args': [], 'kwargs': {}})", "refused naming the granted "
         "ones; never runs", "caller: the run's own registry"),
    Case("T09", "tools", "a pickle (its __reduce__ opens a file) as a tool request's content, "
         "or binary buffers "
         "(tests/test_tools_hostile.py::test_the_host_deserializes_nothing_but_json, "
         "tests/test_tools_hostile.py::"
         "test_binary_buffers_are_refused)", "forge(pickle.dumps(planted))",
         "refused (not JSON, no buffers); nothing unpickled", "caller: parses JSON only"),
    Case("T10", "tools", "a tool that calls back into the sandbox running it (blocking and "
         "async) (tests/test_tools.py::test_a_tool_may_not_call_back_into_its_sandbox, "
         "tests/test_tools.py::test_async_sandbox_runs_sync_tools_off_its_loop)",
         "def reenter(): return sb.run('1')", "RuntimeError at once, as the tool's ToolError",
         "caller: refuse_reentry"),
    Case("T11", "tools", "a call the caller's approval hook refuses "
         "(tests/test_tools.py::test_the_approval_hook_refuses_before_the_tool_runs)",
         "write('rm')", "ToolRefused with the hook's reason; the tool never runs",
         "caller: approve_tool before the tool runs"),
    Case("T12", "tools", "a tool that hangs; calls past the budget; a call in flight at the "
         "run's timeout or an interrupt (tests/test_tools.py::test_a_call_has_a_timeout, "
         "tests/test_tools.py::test_a_run_has_a_call_budget, "
         "tests/test_tools.py::test_a_call_in_flight_when_the_run_times_out_ends_on_both_sides, "
         "tests/test_tools.py::"
         "test_an_interrupt_ends_a_call_in_flight_on_both_sides_and_no_stale_reply_is_taken)",
         "slow(); for i in range(4): f(i)", "ToolTimeout; ToolRefused; the call ends on both "
         "sides, no stale answer taken", "caller: per-call timeout, per-run budget; kernel: the "
         "wait raises"),
    Case("R17", "resources", "hold 512 MiB in scratch files and heap in a 256 MiB kernel",
         "write 8 MiB files, then bytearray(8 MiB), until refused", "ENOSPC, then MemoryError; "
         "< 256 MiB held", "memory limit = scratch tmpfs + RLIMIT_DATA (root)"),
    Case("R09", "resources", "busy loop past the time limit", "while True: pass",
         "ExecutionTimeout, state kept", "deadline (SIGALRM, repeating)"),
    Case("R10", "resources", "output flood", "print('x' * 10**6) in a loop",
         "capped + one marker", "output cap"),
    Case("A01", "protocol", "os._exit(1)", "os._exit(1)", "KernelDied, next run fresh", "client"),
    Case("A02", "protocol", "segfault through ctypes", "ctypes.string_at(0)",
         "KernelDied, next run fresh", "client"),
    Case("A03", "protocol", "stop the own process (SIGSTOP)", "os.kill(os.getpid(), SIGSTOP)",
         "ExecutionTimeout, restarted", "client deadline"),
    Case("A04", "protocol", "close the kernel's sockets", "os.closerange(3, 1024)",
         "KernelDied (libzmq aborts), restarted", "client"),
    Case("A05", "protocol", "forge an execute_result for the next request",
         "session.send(iopub, 'execute_result', ...)", "NOT STOPPED (by design)",
         "none: frontends must treat output as untrusted"),
]


class LoopbackServer:
    """A tiny HTTP server on 127.0.0.1 that counts the requests it gets."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        self.listener.settimeout(0.5)
        while self.listener.fileno() != -1:
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                self.requests += 1
                conn.recv(4096)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\n\r\nserved")

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def world(sandbox):
    """The host's side: canary, secrets, a loopback server, a planted token file."""
    # Not under pytest's 0700 base dir: the kernels' own uids must reach the canary, so that
    # the attacks meet Landlock and the filter, not only file permissions.
    tmp = Path(tempfile.mkdtemp(prefix="sandbox-kernel-hostile-"))
    tmp.chmod(0o755)
    canary = tmp / "canary.txt"
    canary.write_text(CANARY_TEXT)
    (Path(os.environ["HOME"]) / "secret.txt").write_text("secret")
    runtime = Path(os.environ["JUPYTER_RUNTIME_DIR"])
    runtime.mkdir(parents=True, exist_ok=True)
    (runtime / "jpserver-424242.json").write_text(json.dumps({"token": "stolen?"}))
    server = LoopbackServer()
    host_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # stands in for /dev/log
    host_socket.bind(str(tmp / "log.sock"))
    host_socket.setblocking(False)
    values = {"unix_socket": str(tmp / "log.sock"),
              "canary": str(canary), "home": os.environ["HOME"], "runtime": str(runtime),
              "config": os.environ["JUPYTER_CONFIG_DIR"], "port": server.port, "tmp": str(tmp),
              "server": server,
              "other_shell_port": sandbox.manager.get_connection_info()["shell_port"],
              "other_connection_file": sandbox.manager.connection_file}
    yield values
    server.close()
    with pytest.raises(BlockingIOError):  # no datagram reached the host's socket
        host_socket.recv(4096)
    host_socket.close()
    assert canary.read_text() == CANARY_TEXT
    assert oct(canary.stat().st_mode & 0o777) == "0o644"
    shutil.rmtree(tmp, ignore_errors=True)


def _started(policy: SandboxPolicy) -> Sandbox:
    os.environ["HOSTILE_SECRET"] = "do-not-leak"
    os.environ["JUPYTER_TOKEN"] = "server-token"
    try:
        sb = Sandbox(None, policy=policy)
        sb.start()
    finally:
        del os.environ["HOSTILE_SECRET"], os.environ["JUPYTER_TOKEN"]
    ok(sb.run(PRELUDE))
    return sb


HOSTILE_POLICY = dict(memory_limit=512 * 2**20, file_size_limit=4 * 2**20, open_files_limit=256,
                      scratch_size=64 * 2**20, max_output_bytes=10_000)


@pytest.fixture(scope="module")
def kernels(world):
    """The shared hostile kernels: network off, and --allow-network."""
    started = {"hostile": _started(SandboxPolicy(**HOSTILE_POLICY)),
               "net": _started(SandboxPolicy(allow_network=True, **HOSTILE_POLICY))}
    yield started
    for sb in started.values():
        sb.close()


def _applies(case: Case) -> bool:
    return os.geteuid() == 0 or case.id not in ("X19", "R07", "R16")  # root-only


@pytest.mark.parametrize("case", [c for c in CASES if _applies(c)], ids=lambda c: c.id)
def test_attack(kernels, world, case):
    sb = kernels[case.kernel]
    code = case.code
    for name, value in world.items():  # not str.format: the code has braces of its own
        code = code.replace("{" + name + "}", str(value))
    outcome = evaluate(sb, code)
    if isinstance(case.expect, tuple) and isinstance(outcome, list):
        outcome = tuple(outcome)
    assert outcome == case.expect, f"{case.id} {case.attack}: {outcome!r}"
    assert evaluate(sb, "'alive'") == "alive"


def test_loopback_server_heard_no_kernel(kernels, world):
    # N09 (network off) and N12 (network on) never reached the host's loopback server, nor
    # does a direct connection from a network kernel's own namespace.
    assert evaluate(kernels["hostile"], "1") == 1
    direct = evaluate(kernels["net"], "import errno, socket; errno.errorcode[socket.socket()"
                                      f".connect_ex(('127.0.0.1', {world['port']}))]")
    assert direct == "ECONNREFUSED"
    assert world["server"].requests == 0


@pytest.fixture(scope="module")
def victim(world):
    """A kernel for attacks that end or hang it; the client restarts it after each."""
    with Sandbox(None, policy=SandboxPolicy(**HOSTILE_POLICY), grace=2) as sb:
        yield sb


def _assert_recovered(sb: Sandbox) -> None:
    assert evaluate(sb, "'fresh kernel answers'") == "fresh kernel answers"


@pytest.mark.parametrize("code", [
    RAW_SYSCALL + "raw(0x40000000 | 39)",
    RAW_SYSCALL + "import mmap\nm = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE,"
    " prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
    "m.write(b'\\xb8\\x14\\x00\\x00\\x00\\xcd\\x80\\xc3')\n"
    "_ct.CFUNCTYPE(_ct.c_long)(_ct.addressof(_ct.c_char.from_buffer(m)))()",
], ids=["K20", "K21"])
def test_foreign_abi_kills(victim, code):
    process = victim.manager.provisioner.process
    ex = victim.run(code)
    assert process.wait(timeout=10) == -signal.SIGSYS
    assert ex.error.name == "KernelDied" and ex.state_lost
    _assert_recovered(victim)


HOLD_512_MIB = """
import errno, os
held, files, outcome = 0, 0, []
try:
    while held < 512 * 2**20:
        with open(f"fill-{files}.bin", "wb") as f:
            f.write(bytes(8 * 2**20))
        files += 1
        held += 8 * 2**20
except OSError as exc:
    outcome.append(errno.errorcode[exc.errno])
blocks = []
try:
    while held < 512 * 2**20:
        blocks.append(bytearray(8 * 2**20))
        held += 8 * 2**20
except MemoryError:
    outcome.append("MemoryError")
(outcome, held < 256 * 2**20, files > 0, len(blocks) > 0)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the scratch tmpfs needs root")
def test_memory_limit_counts_the_scratch():  # R17
    with Sandbox(None, policy=SandboxPolicy(memory_limit=256 * 2**20)) as sb:
        assert evaluate(sb, HOLD_512_MIB) == (["ENOSPC", "MemoryError"], True, True, True)
        layers = sb.kernel_info()["sandbox"]["layers"]
    quota, data = layers["scratch"]["quota"], layers["limits"]["data"]["hard"]
    assert quota + data == 256 * 2**20 and quota == 64 * 2**20


def test_busy_loop_past_the_limit(victim):  # R09
    ok(victim.run("kept = 41"))
    ex = victim.run("while True:\n    pass", timeout=1)
    assert ex.error.name == "ExecutionTimeout" and not ex.state_lost
    assert evaluate(victim, "kept + 1") == 42


def test_output_flood(victim):  # R10
    ex = ok(victim.run("for _ in range(50):\n    print('x' * 10**6)"))
    assert len(ex.stdout) == 10_000
    assert "50,000,050 bytes" not in ex.stderr  # the cap counts what it dropped, not the total
    assert f"{50 * (10**6 + 1) - 10_000:,} more bytes were dropped" in ex.stderr


@pytest.mark.parametrize("code", ["import os\nos._exit(1)", "import ctypes\nctypes.string_at(0)"],
                         ids=["A01", "A02"])
def test_kernel_death_is_reported(victim, code):
    ex = victim.run(code)
    assert ex.error.name == "KernelDied" and ex.state_lost
    assert "restarted" in ex.error.value
    _assert_recovered(victim)


@pytest.mark.parametrize("code, error", [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", "ExecutionTimeout"),
    ("import os\nos.closerange(3, 1024)\nwhile True:\n    pass", "KernelDied"),
], ids=["A03", "A04"])
def test_unresponsive_kernel_is_replaced(victim, code, error):
    ex = victim.run(code, timeout=1)
    assert ex.error.name == error and ex.state_lost
    _assert_recovered(victim)


def test_forged_output_is_not_stopped(victim):  # A05: documented limitation
    forge = """
k = get_ipython().kernel
k.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'forged\\n'},
               parent=k.get_parent())
"""
    ex = ok(victim.run(forge))
    assert "forged\n" in ex.stdout  # user code can speak as its kernel; frontends must cope


def _children_of(pid: int) -> list[int]:
    """Processes whose parent is pid (a fork-served kernel's command line is its server's)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"\nPPid:\t{pid}\n" in (entry / "status").read_text():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_no_stray_processes_are_left(tmp_path):
    """A kernel that ends leaves nothing behind: not itself, not its scratch reaper."""
    sb = Sandbox(None, policy=SandboxPolicy(**HOSTILE_POLICY))
    sb.start()
    kernel = sb.manager.provisioner.process.pid
    ok(sb.run("import threading\nfor _ in range(5):\n"
              "    threading.Thread(target=__import__('time').sleep, args=(60,)).start()"))
    processes = [kernel, *_children_of(kernel)]
    assert len(processes) == 2  # the kernel and its reaper
    sb.close()
    for _ in range(50):
        if not any(map(_alive, processes)):
            break
        time.sleep(0.1)
    assert not any(map(_alive, processes))


def security_table() -> str:
    """The Markdown table SECURITY.md carries, one row per case."""
    rows = ["| id | group | attack | outcome | stopped by |", "| --- | --- | --- | --- | --- |"]
    for case in [*CASES, *SPECIAL]:
        outcome = case.expect
        if isinstance(outcome, tuple) and len(outcome) == 2 and outcome[0] == -1:
            outcome = f"-1, {errno.errorcode[outcome[1]]}"
        elif isinstance(outcome, tuple) and outcome[1] is not None:
            outcome = f"{outcome[0]} ({errno.errorcode[outcome[1]]})"
        elif isinstance(outcome, tuple):
            outcome = outcome[0]
        rows.append(f"| {case.id} | {case.group} | {case.attack} | {outcome} | {case.layer} |")
    return "\n".join(rows)


def test_each_row_naming_a_test_names_one_that_exists():
    root = Path(__file__).parent.parent
    named = [re.findall(r"(tests/[\w/]+\.py)::(\w+)", case.attack) for case in SPECIAL]
    assert any(named)
    for path, test in (pair for pairs in named for pair in pairs):
        assert f"\ndef {test}(" in (root / path).read_text(), f"{path}::{test}"


def test_security_md_matches_the_suite():
    text = (Path(__file__).parent.parent / "docs" / "SECURITY.md").read_text()
    assert security_table() in text, "regenerate with: python -m tests.test_hostile"


if __name__ == "__main__":
    sys.stdout.write(security_table() + "\n")
