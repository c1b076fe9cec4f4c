"""The kernel process itself: the app's start-up steps, the kernel, the main() call, deadline, output."""
