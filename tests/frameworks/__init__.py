"""Scripts tests/test_frameworks.py runs inside a framework's own venv (not collected by pytest)."""
