"""`python -m sandbox_kernel`: the kernel itself, or the CLI when given a subcommand."""

import sys

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("install", "run", "check", "serve"):
        from sandbox_kernel.cli import main as cli_main

        sys.exit(cli_main())
    # First, while single-threaded and before the heavy imports: a clean environment.
    from sandbox_kernel.confine.environment import ensure_clean

    ensure_clean(sys.argv[1:])
    from sandbox_kernel.app import main

    main()
