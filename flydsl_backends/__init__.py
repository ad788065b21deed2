"""flydsl-backends: the front door (CLI and framework plugins). Imported by nothing in the package."""
__version__ = "0.1.0"
