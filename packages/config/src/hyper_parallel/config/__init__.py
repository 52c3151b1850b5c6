"""Typed, nested, declarative configs (stdlib only)."""
