"""hybrid-kv: a KV-cache manager for hybrid LLMs."""
