"""Drafter training: records -> batches -> trainer; evaluation in vLLM (``eval.py``)."""
