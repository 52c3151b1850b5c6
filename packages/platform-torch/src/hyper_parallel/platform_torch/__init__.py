"""The PyTorch platform adapter for hyper-parallel."""
