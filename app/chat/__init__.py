"""What the chat API families share: the request plan, tools and their parsers, structured output, reasoning, prompts."""
