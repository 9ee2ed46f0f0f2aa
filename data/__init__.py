"""fastmt data package."""
