"""Attention backends behind one interface, chosen at start-up (see `make_backend`)."""

from dataplane.attention.base import AttentionBackend, kv_block_size, make_backend

__all__ = ["AttentionBackend", "kv_block_size", "make_backend"]
