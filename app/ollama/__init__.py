"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, /api/ps, /api/show, /api/pull, ...): docs/ollama.md."""
