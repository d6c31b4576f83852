"""The CPU backend: the NumPy reference's ops, with fast C loops for the hot ones."""
