"""The confinement layers, one module each, and the kernel's unconfined companion.

Layers: environment, scratch, limits, privileges (with view), landlock, seccomp (a package:
rules, program, syscall) and paths; promises says which layer keeps each promise here, denials
explains a refused call to the user. Every layer's failure is an errors.ConfinementError.
The companion: reaper (the process), handover (its channel), logrelay (the kernel's log),
audit (the record of denied calls), vault (what the launcher seals for the companion alone).
Nothing here imports the kernel or anything above it.
"""
