"""Attention backends behind one interface, chosen at start-up (see `make_backend`)."""

from dataplane.attention.base import AttentionBackend, make_backend

__all__ = ["AttentionBackend", "make_backend"]
