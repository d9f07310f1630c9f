"""Allreduce algorithms, their registry and the microbenchmark."""
