"""The confinement layers, one module each: environment, scratch, limits, privileges, landlock,
seccomp, paths and denials. Nothing here imports the kernel or anything else of ours above it."""
