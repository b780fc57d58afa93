"""The reward server's parts: request checks (requests.py), batching (batching.py), the HTTP app (app.py).

`diffusion_rl.rewards.server` is the entry point (`diffusion-rl serve-reward`, `python -m diffusion_rl.rewards.server`).
"""
