"""Orchestration above the HTTP edge: several models with load on demand, Ray Serve replicas."""
