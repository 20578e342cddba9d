"""streamtally: exact per-request token records, usage and billing from LLM token streams."""

__version__ = "0.1.0"
