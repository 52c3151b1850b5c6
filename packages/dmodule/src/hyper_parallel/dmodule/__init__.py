"""Declarative tensor-parallel modules."""
