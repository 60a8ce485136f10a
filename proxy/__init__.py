"""compaction-proxy: an OpenAI-compatible reverse proxy that compacts long chat histories."""

__version__ = "0.1.0"
