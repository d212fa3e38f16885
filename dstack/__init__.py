"""dstack."""
