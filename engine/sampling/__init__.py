"""Choosing tokens: the sampler, constrained decoding (grammars), prompt logprobs."""
