"""Test-only helpers that are not part of the shipped package: the batch runner (batch.py) and
verify_many (many output folders checked for loss parity in one torchrun launch)."""
