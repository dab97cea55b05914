"""Model acquisition, apart from generation: `acquire` takes the settings through the source (`hub`), the device,
the preflight (`preflight`, with the one memory arithmetic in `memory`) and the download, and hands back what to
load; `loader` loads it onto the configured device with the GGUF conversion cache; `engine_factory` builds an
engine over a loaded model; `embedder` is the embedding model; `autotune` holds the load-time probes (dtype,
weight format).

Imports: `main -> app / serving -> models -> engine`. The engine needs none of this: it is built from a loaded model.
"""
