"""Peregrine's generation engine: an async front over a synchronous, continuously batched step loop.

No FastAPI or pydantic here. See docs/architecture.md for the contract the HTTP layer relies on.
"""
