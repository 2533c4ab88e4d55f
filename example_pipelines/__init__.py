"""Example pipelines, loaded by the repository's definitions.py."""
