"""Peregrine's HTTP edge: routers per API family, wire schemas, converters, errors, stream writers."""

from app.server import create_app

__all__ = ["create_app"]
