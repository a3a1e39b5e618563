"""kvlocal: ask questions about long documents with routed KV-cache attention."""

__version__ = "0.1.0"
