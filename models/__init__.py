"""Model acquisition, apart from generation: naming the source and downloading it from the Hub (`hub`),
refusing early when it will not fit (`preflight`), loading it onto the configured device with the GGUF
conversion cache (`loader`), building an engine over a loaded model (`engine_factory`), and the embedding model
(`embedder`).

Imports: `main -> app -> models -> engine`. The engine needs none of this: it is built from a loaded model.
"""
