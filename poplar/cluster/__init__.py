"""Cluster descriptions: the GPU catalogue, cluster files and presets."""
