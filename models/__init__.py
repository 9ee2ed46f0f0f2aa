"""fastmt models package."""
