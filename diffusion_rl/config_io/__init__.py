"""Strict loading of config dataclasses, for any tree of them (the run config, the pretraining config, a loss's
settings): yaml_files.py reads YAML files and dotted overrides, convert.py builds and checks the tree, reference.py
documents every key, secrets.py hides secret values in what a run writes. A leaf: it imports only diffusion_rl.errors.
"""
