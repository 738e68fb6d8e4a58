"""Attention: grouped-query and its masks, rotary embeddings and their scalings, the KV caches."""
