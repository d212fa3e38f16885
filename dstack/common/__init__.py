"""The shared leaf: types, config, errors, slices and the server/runtime seam.

`models/`, `knee_profiler/`, `optimizer/` and `server/` import from here; nothing here
imports another part of the project, so every import points down to this layer.
"""
