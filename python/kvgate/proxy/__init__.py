"""The streaming proxy: request handler, SSE relay, upstream backends."""
