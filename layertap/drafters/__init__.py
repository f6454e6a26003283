"""Drafter models (EAGLE-3, DFlash) trained from captured hidden states, and their export to vLLM."""
