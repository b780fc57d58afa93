"""CLI subcommands, one module each; each defines `register(subparsers)` (see diffusion_rl/cli.py)."""
