"""Running the model: the runner, the forward pass, attention, the paged KV cache, quantized weights."""
