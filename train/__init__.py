"""fastmt train package."""
