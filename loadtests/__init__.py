"""loadtests."""
