"""A Jupyter kernel for untrusted Python code."""

__version__ = "0.1.0"
