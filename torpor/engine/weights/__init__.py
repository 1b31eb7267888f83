"""Weights: checkpoint files and their loading, payloads and manifests of updates, transports to trainers."""
