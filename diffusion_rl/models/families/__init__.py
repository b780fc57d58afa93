"""One module per model family: its FlowModel adapter and its registration (models/registry.py)."""
