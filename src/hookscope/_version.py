__version__ = "0.1.0"
"""The installed hookscope's version, ``MAJOR.MINOR.PATCH`` (semantic versioning)."""
