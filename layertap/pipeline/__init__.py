"""One command from live vLLM to a trained drafter: config, inference manager, online loop, report,
OpenAI server with capture, Ray scale-out. See ``run.py`` for the flow."""
