"""Compatibility name: the course's test files import the model's layers from cs336_basics."""
