"""Anthropic's Messages API family: routes, wire schemas, the one converter to the chat form, its events and errors."""
