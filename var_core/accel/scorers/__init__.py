"""scorers components (one per file; importing the package registers nothing until a registry loads it)."""
