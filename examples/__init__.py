"""Runnable examples: `python -m examples.rl_demo` (the main job), `python -m examples.bisect_walkthrough`."""
