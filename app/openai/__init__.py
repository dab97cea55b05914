"""The OpenAI API family: routes, wire schemas, the one wire<->engine converter."""
