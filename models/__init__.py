"""Model acquisition, apart from generation: `acquire` takes the settings through the source (`hub`), the device,
the preflight (`preflight`, with the one memory arithmetic in `memory`) and the download, and hands back what to
load; `loader` loads it onto the configured device with the GGUF conversion cache; `embedder` is the embedding
model; `autotune` holds the load-time probes (dtype, weight format).

Imports: `main -> app / serving -> models -> engine`. The engine needs none of this, except `AsyncEngine.from_config`
(and `LLMEngine.from_config`), the convenience that loads a model through `models.loader` before building
the engine around it.
"""
