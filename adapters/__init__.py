"""Framework adapters: each finds the HTTP client a framework really sends through."""
