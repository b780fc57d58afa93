"""Direct-preference / forward-process losses (Diffusion-DPO, DiffusionNFT, AWM), one file each with the algorithm
that runs it, and their pairing, timestep and adapter-decay helpers. Importing this package registers the losses."""

from diffusion_rl.algorithms.preference.awm import WEIGHTINGS, AwmInput, awm_log_p, awm_loss
from diffusion_rl.algorithms.preference.base import PREFERENCE_LOSSES
from diffusion_rl.algorithms.preference.dpo import DpoInput, dpo_loss
from diffusion_rl.algorithms.preference.nft import NftInput, nft_loss, reward_probability
from diffusion_rl.algorithms.preference.pairs import PreferencePairs, online_pairs
from diffusion_rl.algorithms.preference.schedules import OLD_DECAY_KINDS, ema_decay_awm, old_decay
from diffusion_rl.algorithms.preference.timesteps import awm_timestep_indices, dpo_timesteps, nft_timestep_indices

__all__ = [
    "OLD_DECAY_KINDS",
    "PREFERENCE_LOSSES",
    "WEIGHTINGS",
    "AwmInput",
    "DpoInput",
    "NftInput",
    "PreferencePairs",
    "awm_log_p",
    "awm_loss",
    "awm_timestep_indices",
    "dpo_loss",
    "dpo_timesteps",
    "ema_decay_awm",
    "nft_loss",
    "nft_timestep_indices",
    "old_decay",
    "online_pairs",
    "reward_probability",
]
