"""The platform seam: the small protocol through which hyper-parallel reaches a framework."""
