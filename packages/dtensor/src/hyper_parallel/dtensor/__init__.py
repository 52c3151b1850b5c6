"""Distributed tensors: DeviceMesh, placements, DTensor, redistribute."""
