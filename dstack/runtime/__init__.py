"""Serving: the dispatch core (pure), and around it the asyncio runtime, the worker
supervisor, the re-planner, worker processes and shared-memory tensors.
"""
