"""API keys in the gateway: the cached key table (`table`), per-key rate limits (`limits`), usage and
budgets (`usage`), the pure per-key policy (`policy`), and what a request's key lets it do (`gate`).
Nothing here knows how requests are routed."""
