"""One router per resource: generate, requests, health, profile, metrics."""
