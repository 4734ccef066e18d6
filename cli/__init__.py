"""The `ingot` command line (typer)."""
