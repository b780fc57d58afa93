"""The configuration: one typed dataclass tree, loaded from YAML plus dotted `key=value` overrides.

One module per section group (model, sampling, data, algorithm, train, log, engine); each holds its sections and the
checks that tie them to the rest of the config, which `Config` runs once the tree is built. Every field has a default,
a one-line help text and, for sizes, counts and rates, a range the loader checks (config_io/convert.py);
`__post_init__` rejects impossible combinations with a message that says what to change.
`diffusion-rl config show CONFIG` prints the resolved tree and `docs/config.md` is generated from it
(`diffusion-rl config reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_rl.config.algorithm import AlgorithmConfig, check_algorithm, check_rollout_correction
from diffusion_rl.config.data import DataConfig, RewardSpec, check_batch, check_rewards
from diffusion_rl.config.engine import EngineConfig, check_engine
from diffusion_rl.config.log import LogConfig, ProfileConfig
from diffusion_rl.config.model import ModelConfig
from diffusion_rl.config.sampling import SamplingConfig, check_tree, check_window
from diffusion_rl.config.train import RunConfig, TrainConfig, ValConfig, check_val
from diffusion_rl.config_io.yaml_files import load_config
from diffusion_rl.guard.config import GuardConfig
from diffusion_rl.settings import opt


@dataclass
class Config:
    run: RunConfig = opt(RunConfig, "Run identity and resume.", factory=True)
    model: ModelConfig = opt(ModelConfig, "Model to train.", factory=True)
    sampling: SamplingConfig = opt(SamplingConfig, "Training rollouts.", factory=True)
    data: DataConfig = opt(DataConfig, "Prompts.", factory=True)
    rewards: list[RewardSpec] = opt(lambda: [RewardSpec()], "Rewards, summed with their weights.", factory=True)
    algorithm: AlgorithmConfig = opt(AlgorithmConfig, "Algorithm and loss.", factory=True)
    train: TrainConfig = opt(TrainConfig, "Optimisation.", factory=True)
    val: ValConfig = opt(ValConfig, "Validation.", factory=True)
    log: LogConfig = opt(LogConfig, "Metrics and trackers.", factory=True)
    engine: EngineConfig = opt(EngineConfig, "Execution engine.", factory=True)
    profile: ProfileConfig = opt(ProfileConfig, "torch.profiler traces of chosen steps.", factory=True)
    guard: GuardConfig = opt(GuardConfig, "Reward-hacking guard: image statistics no reward optimises.", factory=True)

    def __post_init__(self):
        # the checks that span sections, each next to the section it is about
        check_val(self)
        check_batch(self)
        check_window(self.sampling)
        check_algorithm(self)
        check_tree(self)
        check_engine(self)  # may set algorithm.rollout_correction.mode=decoupled: before the check of its criteria
        check_rollout_correction(self.algorithm)
        check_rewards(self)

    @property
    def batch_size(self) -> int:
        """Rows of a training step: prompts × group size; offline pairs: chosen and rejected of each."""
        return self.data.batch_size


def load(path: str | None, overrides: list[str] = ()) -> Config:
    return load_config(Config, path, list(overrides))
