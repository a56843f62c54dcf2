"""The demo: a small transformer, a synthetic language of known entropy, and the runner."""
