"""Planning library: layouts, dataflow graphs, cost model, reallocation plans, simulator, search.

Pure Python (pydantic and numpy at most): never imports torch, ray or another package of ours.
"""
