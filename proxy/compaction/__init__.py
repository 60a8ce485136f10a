"""Compaction strategies and the summarizer they call."""
