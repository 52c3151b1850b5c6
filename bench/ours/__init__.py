"""hyper-parallel's own implementations for the step bench: (c) all-DTensor, (d) local_map."""
