"""knee_profiler."""
