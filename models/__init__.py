"""Model acquisition, apart from generation: naming the source and downloading it from the Hub (`hub`),
refusing early when it will not fit (`preflight`), loading it onto the configured device with the GGUF
conversion cache (`loader`), and the embedding model (`embedder`).

Imports: `main -> app -> models -> engine`. The engine needs none of this, except `AsyncEngine.from_config`
(and `LLMEngine.from_config`), the convenience that loads a model through `models.loader` before building
the engine around it.
"""
