"""The tapping reverse proxy of `streamtally proxy`: LLM API calls forwarded, their responses
teed to a `Tap` (`server.py`).

What it tees and how (`tee.py`, `encodings.py`, `oversize.py`), the usage it asks for
(`usage_ask.py`), who pays (`api_keys.py`), and its counts and metrics (`stats.py`,
`metrics.py`). The command line is `streamtally.cli.proxy`; the manual docs/tap.md.
"""

from streamtally.producers.proxy.server import (
    Listen,
    ProxyOptions,
    ProxyServer,
    ProxyStats,
    describe,
    serve_metrics,
)

__all__ = ["Listen", "ProxyOptions", "ProxyServer", "ProxyStats", "describe", "serve_metrics"]
