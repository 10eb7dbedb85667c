"""The one place the version is written: the package exports it and pyproject reads it."""

__version__ = "0.1.0"
