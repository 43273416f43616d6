"""Runnable examples (scripts; importable for the tests)."""
