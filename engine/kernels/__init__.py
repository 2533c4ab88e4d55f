"""Compiled kernels, each behind a loader that says whether it is available here."""
