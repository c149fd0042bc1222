"""The package version (a leaf: what exports record without importing the package's API)."""

__version__ = "0.1.0"
