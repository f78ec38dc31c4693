"""Small helpers shared across the package (no torch imported here: reward worker processes use them)."""
