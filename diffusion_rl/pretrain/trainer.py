"""The pretraining (SFT) trainer: a tiny model learns ShapesWorld from scratch, in two phases.

1. `vae`: the autoencoder learns to reconstruct fresh ShapesWorld images; then it is frozen and its latent
   shift/scale are set from the data (latents of zero mean and unit std, what flow matching assumes).
2. `flow`: the transformer learns the flow-matching velocity on a pool of training images encoded once, with
   logit-normal timesteps and some empty prompts (for classifier-free guidance); an EMA of its weights is kept.

Steps count both phases: `vae.steps` VAE steps, then `flow.steps` flow steps. Every random draw of step k comes
from a generator seeded by (run.seed, phase, k), so a resumed run repeats the steps a straight run would take.
The result is exported in diffusers format to run.out, with the prompt split and the final scores.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from diffusion_rl.checkpoint.manifest import verify_checkpoint
from diffusion_rl.checkpoint.paths import step_dir_name, step_of
from diffusion_rl.checkpoint.state import load_state_file, state_fits
from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.config.loading import to_yaml
from diffusion_rl.config.secrets import redact_secrets
from diffusion_rl.data.shapes import ShapesWorld, spread_subset
from diffusion_rl.engine.ema import EmaWeights
from diffusion_rl.errors import UserError
from diffusion_rl.models.base import freeze
from diffusion_rl.models.families.sd3 import SD3Model
from diffusion_rl.pretrain.config import PretrainConfig
from diffusion_rl.pretrain.evaluate import sample_specs, score_images
from diffusion_rl.pretrain.flow_matching import cosine_lr_factor, flow_matching_loss, logit_normal_sigmas, noisy_latents
from diffusion_rl.pretrain.model import build_pipeline, check_out, export_model
from diffusion_rl.pretrain.vae import latent_stats, reconstruction_mse, to_pixels, vae_loss
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.tracking import ConsoleTracker, image_grid, make_trackers, plot_metrics, read_metrics, save_png
from diffusion_rl.trainer.timing import PhaseTimer
from diffusion_rl.utils.rng import capture_rng_state, restore_rng_state
from diffusion_rl.utils.seeding import make_generator

logger = logging.getLogger(__name__)

STATE_FILE = "pretrain_state.pt"
CONSOLE_FIELDS = (
    ("vae/loss", "vae_loss", "{:.4g}", True),
    ("vae/probe_mse", "vae_probe_mse", "{:.4g}", True),
    ("flow/loss", "flow_loss", "{:.4g}", True),
    ("eval/shapes/geneval", "heldout_geneval", "{:.3f}", True),
)
_PROBE = 64  # fixed held-out images on which the VAE's reconstruction error is reported


class PretrainTrainer:
    def __init__(self, cfg: PretrainConfig):
        check_out(cfg)  # before any work: the export must not replace what is not this config's model
        self.cfg = cfg
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        self.run_dir = Path(cfg.run.dir)
        self.world = ShapesWorld(cfg.model.size, cfg.data.split_seed, cfg.data.heldout_fraction)
        self.pipeline = build_pipeline(cfg)
        self.vae, self.transformer = self.pipeline.vae, self.pipeline.transformer
        # eval (in freeze): T5's dropout would corrupt the cached prompt embeddings
        freeze(self.pipeline.text_encoder, self.pipeline.text_encoder_2, self.pipeline.text_encoder_3)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.keep_last)
        if cfg.run.resume == "never":
            self.checkpoints.set_aside_earlier_run()
        _, probe = self.world.batch(range(_PROBE), "heldout", stream="vae_probe")
        self.probe = to_pixels(probe)
        self.vae_optimizer = torch.optim.AdamW(self.vae.parameters(), lr=cfg.vae.lr)
        self.stats: tuple[float, float] | None = None  # the VAE's latent (shift, scale), set when phase 1 ends
        self.flow_ready = False
        self.step = 0
        self.trackers = None

    # -- the loop --------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Run (or resume) both phases, export the model, and return its final ShapesWorld scores."""
        cfg = self.cfg
        resume_from = self.checkpoints.resolve_resume(cfg.run.resume)
        if resume_from is not None:
            self.load_checkpoint(resume_from)
            self.checkpoints.set_aside_later(step_of(resume_from))  # an earlier checkpoint resumed on purpose
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(redact_secrets(cfg)))
        self.trackers = make_trackers(
            self.run_dir, tensorboard=cfg.log.tensorboard, console_every=0, config=redact_secrets(cfg)
        )
        if cfg.log.console_every > 0:
            self.trackers.trackers.append(ConsoleTracker(cfg.log.console_every, fields=CONSOLE_FIELDS))
        self.trackers.resume_from(self.step)
        try:
            if self.step == 0:
                self.trackers.log_metrics({"vae/probe_mse": reconstruction_mse(self.vae, self.probe)}, 0)
            self._loop()
            final = self.evaluate(final=True)
            self.trackers.log_metrics(final, self.step)
        finally:
            self.trackers.close()
            self.trackers = None
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        plot_metrics(rows, self.run_dir / "loss.png", keys=("vae/loss", "flow/loss", "eval/shapes/geneval"))
        with self._ema_weights():
            export_model(cfg, self.pipeline, {key.removeprefix("eval/"): v for key, v in final.items()})
        return final

    def _loop(self) -> None:
        cfg = self.cfg
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc="pretrain", dynamic_ncols=True,
                   disable=None if cfg.log.progress_bar else True)  # fmt: skip
        sums: dict[str, float] = {}
        count = 0
        while self.step < cfg.total_steps:
            timer = PhaseTimer()
            if self.step < cfg.vae.steps:
                with timer("vae"):
                    metrics = self.vae_step(self.step)
            else:
                if not self.flow_ready:
                    with timer("prepare_flow"):
                        self.prepare_flow()
                with timer("flow"):
                    metrics = self.flow_step(self.step - cfg.vae.steps)
            self.step += 1
            metrics.update(timer.metrics())
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
            count += 1
            out = {}
            last = self.step == cfg.total_steps
            if self.step == cfg.vae.steps:
                out["vae/probe_mse"] = reconstruction_mse(self.vae, self.probe)
            flow_step = self.step - cfg.vae.steps
            if not last and flow_step > 0 and cfg.eval.every > 0 and flow_step % cfg.eval.every == 0:
                out.update(self.evaluate())
            if last or (cfg.save_every > 0 and self.step % cfg.save_every == 0):
                self.save_checkpoint()
            if last or self.step % cfg.log.every == 0 or out:
                out.update({key: total / count for key, total in sums.items()})
                sums, count = {}, 0
                self.trackers.log_metrics(out, self.step)
            bar.update(1)
            shown = {k: metrics[k] for k in ("vae/loss", "flow/loss") if k in metrics}
            bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
        bar.close()

    # -- phase 1: the autoencoder ----------------------------------------------------------------------------
    def vae_step(self, step: int) -> dict[str, float]:
        v = self.cfg.vae
        _, images = self.world.batch(range(step * v.batch_size, (step + 1) * v.batch_size), stream="vae")
        self.vae.train()
        loss, metrics = vae_loss(
            self.vae, to_pixels(images), v.kl_weight, make_generator(self.cfg.run.seed, "vae", step)
        )
        self.vae_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.vae_optimizer.step()
        return {"vae/loss": loss.item(), **metrics}

    # -- phase 2: the transformer ----------------------------------------------------------------------------
    def prepare_flow(self) -> None:
        """Freeze the VAE, set its latent scale, encode the image pool and the prompts, build the optimizer."""
        cfg, f = self.cfg, self.cfg.flow
        self.vae.requires_grad_(False).eval()
        if self.stats is None:
            _, images = self.world.batch(range(cfg.vae.stats_images), stream="vae_stats")
            self.stats = latent_stats(self.vae, to_pixels(images))
        shift, scale = self.stats
        self.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        specs, images = self.world.batch(range(f.latent_pool), stream="flow_pool")
        with torch.no_grad():
            pixels = to_pixels(images)
            pool = [self.vae.encode(pixels[i : i + 256]).latent_dist.mean for i in range(0, len(pixels), 256)]
        self.pool = (torch.cat(pool) - shift) * scale  # [N, C, h, w], what the transformer denoises
        prompts = sorted({s.prompt() for s in specs})
        self.pool_text = torch.tensor([prompts.index(s.prompt()) for s in specs])
        self.empty_text = len(prompts)  # index of "" in the text cache: the unconditional prompt
        self.text, self.pooled_text = self._encode_text([*prompts, ""])
        params = list(self.transformer.parameters())
        self.flow_optimizer = torch.optim.AdamW(params, lr=f.lr, weight_decay=f.weight_decay)
        self.flow_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.flow_optimizer, lambda k: cosine_lr_factor(k, f.steps, f.warmup_steps, f.min_lr_ratio)
        )
        self.ema = EmaWeights(params, f.ema_decay) if f.ema_decay > 0 else None
        self.flow_ready = True
        logger.info("flow phase: %d pool images, %d distinct prompts", len(self.pool), len(prompts))

    @torch.no_grad()
    def _encode_text(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled = [], []
        for i in range(0, len(prompts), 128):
            e, _, p, _ = self.pipeline.encode_prompt(
                prompt=prompts[i : i + 128], prompt_2=None, prompt_3=None, device=torch.device("cpu"),
                do_classifier_free_guidance=False, max_sequence_length=self.cfg.model.text_tokens,
            )  # fmt: skip
            embeds.append(e)
            pooled.append(p)
        return torch.cat(embeds), torch.cat(pooled)

    def flow_step(self, k: int) -> dict[str, float]:
        f = self.cfg.flow
        g = make_generator(self.cfg.run.seed, "flow", k)
        index_B = torch.randint(len(self.pool), (f.batch_size,), generator=g)
        x0 = self.pool[index_B]
        noise = torch.randn(x0.shape, generator=g)
        sigma_B = logit_normal_sigmas(f.batch_size, f.logit_mean, f.logit_std, g)
        drop_B = torch.rand(f.batch_size, generator=g) < f.cond_dropout
        text_B = torch.where(drop_B, self.empty_text, self.pool_text[index_B])
        self.transformer.train()
        v = self.transformer(
            hidden_states=noisy_latents(x0, noise, sigma_B),
            timestep=sigma_B * self.pipeline.scheduler.config.num_train_timesteps,
            encoder_hidden_states=self.text[text_B],
            pooled_projections=self.pooled_text[text_B],
            return_dict=False,
        )[0]
        loss = flow_matching_loss(v, x0, noise)
        self.flow_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = f.grad_clip if f.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), max_norm))
        lr = self.flow_scheduler.get_last_lr()[0]
        self.flow_optimizer.step()
        self.flow_scheduler.step()
        if self.ema is not None:
            self.ema.update()
        return {"flow/loss": loss.item(), "flow/grad_norm": grad_norm, "flow/lr": lr}

    # -- evaluation ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _ema_weights(self):
        with self.ema.swapped_in() if self.flow_ready and self.ema is not None else contextlib.nullcontext():
            yield

    def evaluate(self, final: bool = False) -> dict[str, float]:
        """ShapesWorld scores of ODE samples of held-out prompts (EMA weights), and a grid of them."""
        cfg, e = self.cfg, self.cfg.eval
        if not self.flow_ready:  # no flow steps were configured: the transformer is still random
            self.prepare_flow()
        specs = [s for s in spread_subset(self.world.heldout, e.prompts) for _ in range(e.n)]
        settings = SamplerSettings(e.num_steps, e.guidance, cfg.model.size, cfg.model.size)
        model = SD3Model(self.pipeline, lora=None, device=torch.device("cpu"), dtype=torch.float32,
                         max_sequence_length=cfg.model.text_tokens)  # fmt: skip
        with self._ema_weights():
            images = sample_specs(model, specs, settings, e.seed)
        metrics = {f"eval/{k}": v for k, v in score_images(specs, images).items()}
        captions = [s.prompt() for s in specs]
        name = "final" if final else step_dir_name(self.step)
        save_png(image_grid(images[:64], captions[:64], ncols=8), self.run_dir / "samples" / f"{name}.png")
        logger.info("step %d: held-out geneval %.3f", self.step, metrics["eval/shapes/geneval"])
        return metrics

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        def write(directory: Path) -> None:
            save_file(self.vae.state_dict(), directory / "vae.safetensors")
            save_file({k: v.contiguous() for k, v in self.transformer.state_dict().items()},
                      directory / "transformer.safetensors")  # fmt: skip
            state = {
                "step": self.step,
                "stats": self.stats,
                "vae_optimizer": self.vae_optimizer.state_dict(),
                "rng": capture_rng_state(),
            }
            if self.flow_ready:
                state["flow_optimizer"] = self.flow_optimizer.state_dict()
                state["flow_scheduler"] = self.flow_scheduler.state_dict()
                state["ema"] = self.ema.state_dict() if self.ema is not None else None
            torch.save(state, directory / STATE_FILE)
            (directory / "config.yaml").write_text(to_yaml(redact_secrets(self.cfg)))

        return self.checkpoints.save(self.step, write)

    def load_checkpoint(self, path: Path) -> None:
        verify_checkpoint(path)  # its files as saved (checkpoint/manifest.py)
        state = load_state_file(path / STATE_FILE)
        if state["step"] != step_of(path):
            raise UserError(f"checkpoint {path} holds step {state['step']}, not the step its name says")
        self.vae.load_state_dict(load_file(path / "vae.safetensors"))
        self.transformer.load_state_dict(load_file(path / "transformer.safetensors"))
        with state_fits(path / STATE_FILE):
            self.vae_optimizer.load_state_dict(state["vae_optimizer"])
            self.step, self.stats = state["step"], state["stats"]
            if "flow_optimizer" in state:
                self.prepare_flow()
                self.flow_optimizer.load_state_dict(state["flow_optimizer"])
                self.flow_scheduler.load_state_dict(state["flow_scheduler"])
                if self.ema is not None and state["ema"] is not None:
                    self.ema.load_state_dict(state["ema"])
            restore_rng_state(state["rng"])
        logger.info("resumed pretraining from %s (step %d)", path, self.step)
