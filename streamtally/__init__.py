"""streamtally: exact per-request token records, usage and billing from LLM token streams."""

from streamtally import _native

__version__ = "0.1.0"

# First, before any other module of the package: the compiled hot path, if built and fresh.
_native.activate()
