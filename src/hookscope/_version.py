__version__ = "0.2.0"
"""The installed hookscope's version, ``MAJOR.MINOR.PATCH`` (semantic versioning)."""
