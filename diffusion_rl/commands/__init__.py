"""CLI subcommands, one module each; each defines `register(subparsers)` (see diffusion_rl/cli.py)."""

import argparse


def prepare_subparsers(subparsers):
    """The subcommands of `diffusion-rl prepare` (made here when the cli has not added `prepare` yet)."""
    prepare = subparsers.choices.get("prepare") or subparsers.add_parser("prepare", help="prepare datasets")
    datasets = next((a for a in prepare._actions if isinstance(a, argparse._SubParsersAction)), None)
    if datasets is None:
        datasets = prepare.add_subparsers(dest="dataset", required=True)
    return datasets
