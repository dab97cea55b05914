"""OpenAI's Responses API (`/v1/responses`): a thin front over the chat pipeline, with a stored-response database."""
