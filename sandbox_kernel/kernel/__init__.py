"""The kernel process itself: start-up steps, the kernel, the main() call, deadline, output."""
