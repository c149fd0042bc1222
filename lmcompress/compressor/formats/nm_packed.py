"""Placeholder: being written (issue 9)."""
