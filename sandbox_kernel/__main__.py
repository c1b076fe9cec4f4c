"""`python -m sandbox_kernel`: the kernel itself, or the CLI when given a subcommand."""

import sys

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("install", "uninstall", "run", "check", "serve",
                                             "runtime", "eg-launch", "mcp"):
        from sandbox_kernel.cli import main as cli_main

        sys.exit(cli_main())
    # A kernel ignores SIGINT outside its executions (ipykernel's init_signal), and jupyter_client
    # interrupts every kernel it shuts down: one stopped while it still starts (a cold start
    # cancelled, a server closing) printed a KeyboardInterrupt traceback into its launcher's
    # stderr. It ignores SIGINT from its first instruction instead.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # First, while single-threaded and before the heavy imports: a clean environment.
    from sandbox_kernel.confine.environment import ensure_clean

    ensure_clean(sys.argv[1:])
    # The sandbox refuses the debugger (debugpy's adapter is a subprocess), yet ipykernel
    # imports debugpy at start (60-125 ms). None tells ipykernel, and user code, it is absent.
    sys.modules["debugpy"] = None  # type: ignore[assignment]
    from sandbox_kernel.kernel.app import main

    main()
