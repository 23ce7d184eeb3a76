"""Serving: the Triton model repository, Kubernetes manifests, releases and the local Triton server."""
