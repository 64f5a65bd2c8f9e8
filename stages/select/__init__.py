"""Candidate batch → selected batch: sample-selection methods and the irreducible-loss model."""
