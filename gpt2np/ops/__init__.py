"""The op contract (what every backend implements, and each op's cost) and the
plain NumPy reference."""
