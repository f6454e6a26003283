"""Adapters that let other tools use layertap as their hidden-state source (optional dependencies)."""
