"""Shared helpers of the verify tests (reference digests, sample traces and checkpoints)."""
