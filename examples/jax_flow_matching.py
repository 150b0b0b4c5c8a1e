"""A small Flax/Optax DiT trained with latentmill's flow-matching objective on a latentmill snapshot.

What it shows: the snapshot that ``latentmill prep`` publishes (safetensors inside plain tars) feeds a JAX
trainer as it is, through ``latentmill.jax.JaxLatentLoader`` (the torch loader's batches, exactly). It is a
data path for JAX, not a port of Flux: the model is a few-block DiT with random initial weights.

    python examples/jax_flow_matching.py outputs/demo --steps 200 --out outputs/jax-demo
    python examples/jax_flow_matching.py outputs/demo/snapshots/0001-... --steps 50

The objective is ``latentmill.trainer.objective``'s (Diffusers' Flux/SD3 convention), re-written in jax.numpy:

    sigma  ~ logit_normal(mean, std) (or uniform), then shifted: s * sigma / (1 + (s - 1) * sigma)
    x_sig  = (1 - sigma) * x0 + sigma * noise,     target = noise - x0,     loss = mean((pred - target)^2)

with ``s`` the fixed ``--shift`` or, with ``--shift-mode resolution``, Flux's ``exp(mu)`` (mu linear in the
latent token count). A cache of ``"latents": "distribution"`` draws ``x0 = mean + std * eps`` each time.

Compiled pieces: ``train_step`` is one ``jax.jit`` function (loss, gradients, AdamW update; one compile per
bucket shape), and ``make_sampler`` returns one ``jax.jit`` function holding the whole Euler denoising loop
(``jax.lax.fori_loop``), ``jax.vmap``-ed over samples. Timings are warm-up excluded
(``latentmill.timing.steady_state``): the first call (compilation) is reported on its own, then the median
of the later calls. On a GPU pod set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` if other processes share it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from latentmill.jax import JaxLatentLoader, resolve_snapshot_dir
from latentmill.timing import steady_state

# Shapes: B batch, C latent channels, F latent frames (1 for images), H/W latent height/width, N tokens,
# L text tokens, D text width, P pooled width, E model width.


@dataclass(frozen=True)
class DiTConfig:
    """The model's size: ``depth`` blocks of joint attention over text and latent tokens, ``width`` wide."""

    patch: int = 2
    width: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4


@dataclass(frozen=True)
class Objective:
    """How noise levels are drawn: the fields of ``TrainerConfig`` that ``trainer.objective`` reads."""

    timestep_sampling: str = "logit_normal"  # or "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    shift_mode: str = "fixed"  # or "resolution" (Flux: shift = exp(mu), mu linear in the token count)
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096


# ------------------------------------------------------------------ the objective (trainer/objective.py)
def shift_sigmas(sigmas: jax.Array, shift: float) -> jax.Array:
    """Flux/SD3 timestep shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma)."""
    return sigmas if shift == 1.0 else shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def shift_for(obj: Objective, seq_len: int) -> float:
    """The shift of a batch of ``seq_len`` latent tokens (``trainer.objective.shift_for``)."""
    if obj.shift_mode == "fixed":
        return obj.shift
    m = (obj.max_shift - obj.base_shift) / (obj.max_image_seq_len - obj.base_image_seq_len)
    return math.exp(seq_len * m + (obj.base_shift - m * obj.base_image_seq_len))


def sample_sigmas(key: jax.Array, n: int, obj: Objective, shift: float) -> jax.Array:
    """``n`` noise levels in [0, 1] (float32): logit-normal or uniform, then shifted."""
    if obj.timestep_sampling == "logit_normal":
        sigmas = jax.nn.sigmoid(obj.logit_mean + obj.logit_std * jax.random.normal(key, (n,), jnp.float32))
    elif obj.timestep_sampling == "uniform":
        sigmas = jax.random.uniform(key, (n,), jnp.float32)
    else:
        raise ValueError(f"timestep_sampling {obj.timestep_sampling!r}: this example draws logit_normal or uniform")
    return shift_sigmas(sigmas, shift)


def _per_sample(values_B: jax.Array, like: jax.Array) -> jax.Array:
    return values_B.reshape(-1, *([1] * (like.ndim - 1))).astype(like.dtype)


def flow_matching_loss(pred: jax.Array, latents: jax.Array, noise: jax.Array) -> jax.Array:
    """Mean squared error against the velocity ``noise - latents``, in float32."""
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - (noise - latents).astype(jnp.float32)))


# ------------------------------------------------------------------ the model: a small DiT
def timestep_embedding(t_B: jax.Array, dim: int, max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding [B, dim] of timesteps (sigma * 1000, as Diffusers' Flux passes them)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t_B[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def position_embedding(frames: int, rows: int, cols: int, dim: int) -> jax.Array:
    """Fixed sin-cos positions [F*rows*cols, dim]: a third of the width each for frame, row and column."""
    third = (dim // 6) * 2

    def one(n: int, width: int) -> jax.Array:
        return timestep_embedding(jnp.arange(n, dtype=jnp.float32), width, max_period=100.0)

    f, r, c = one(frames, third), one(rows, third), one(cols, dim - 2 * third)
    grid = jnp.concatenate([
        jnp.broadcast_to(f[:, None, None], (frames, rows, cols, third)),
        jnp.broadcast_to(r[None, :, None], (frames, rows, cols, third)),
        jnp.broadcast_to(c[None, None, :], (frames, rows, cols, dim - 2 * third)),
    ], axis=-1)
    return grid.reshape(frames * rows * cols, dim)


class Block(nn.Module):
    """A DiT block with adaLN-zero modulation: joint self-attention over [text; latent] tokens, then an MLP."""

    width: int
    heads: int
    mlp_ratio: int

    @nn.compact
    def __call__(self, h_BNE: jax.Array, c_BE: jax.Array) -> jax.Array:
        mod = nn.Dense(6 * self.width, kernel_init=nn.initializers.zeros)(nn.silu(c_BE))[:, None]
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mod, 6, axis=-1)
        y = nn.LayerNorm(use_scale=False, use_bias=False)(h_BNE) * (1 + scale1) + shift1
        h_BNE = h_BNE + gate1 * nn.MultiHeadDotProductAttention(num_heads=self.heads)(y)
        y = nn.LayerNorm(use_scale=False, use_bias=False)(h_BNE) * (1 + scale2) + shift2
        y = nn.Dense(self.width)(nn.gelu(nn.Dense(self.mlp_ratio * self.width)(y)))
        return h_BNE + gate2 * y


class DiT(nn.Module):
    """Predicts the flow-matching velocity of latents [B, C, H, W] (images) or [B, C, F, H, W] (videos) at
    noise levels sigma [B], conditioned on text tokens [B, L, D] and, where the cache has them (Flux),
    pooled text embeddings [B, P]. The output has the latents' shape; it is zero at initialisation."""

    cfg: DiTConfig

    @nn.compact
    def __call__(self, x: jax.Array, sigma_B: jax.Array, text_BLD: jax.Array,
                 pooled_BP: jax.Array | None = None) -> jax.Array:
        cfg, p = self.cfg, self.cfg.patch
        video = x.ndim == 5
        x_BCFHW = x if video else x[:, :, None]
        B, C, F, H, W = x_BCFHW.shape
        rows, cols = H // p, W // p
        patches = x_BCFHW.reshape(B, C, F, rows, p, cols, p).transpose(0, 2, 3, 5, 4, 6, 1)
        tokens_BNE = nn.Dense(cfg.width)(patches.reshape(B, F * rows * cols, p * p * C))
        tokens_BNE = tokens_BNE + position_embedding(F, rows, cols, cfg.width)[None]
        text_BLE = nn.Dense(cfg.width)(text_BLD)
        c_BE = nn.Dense(cfg.width)(nn.silu(nn.Dense(cfg.width)(timestep_embedding(sigma_B * 1000.0, cfg.width))))
        if pooled_BP is not None:
            c_BE = c_BE + nn.Dense(cfg.width)(pooled_BP)
        h = jnp.concatenate([text_BLE, tokens_BNE], axis=1)
        for _ in range(cfg.depth):
            h = Block(cfg.width, cfg.heads, cfg.mlp_ratio)(h, c_BE)
        h = h[:, text_BLE.shape[1]:]  # the latent tokens
        shift, scale = jnp.split(nn.Dense(2 * cfg.width, kernel_init=nn.initializers.zeros)(nn.silu(c_BE))[:, None],
                                 2, axis=-1)
        h = nn.LayerNorm(use_scale=False, use_bias=False)(h) * (1 + scale) + shift
        out = nn.Dense(p * p * C, kernel_init=nn.initializers.zeros)(h)  # adaLN-zero: the velocity starts at 0
        out = out.reshape(B, F, rows, cols, p, p, C).transpose(0, 6, 1, 2, 4, 3, 5).reshape(B, C, F, H, W)
        return out if video else out[:, :, 0]


def token_count(latent_shape: tuple[int, ...], patch: int) -> int:
    """Latent tokens of one sample (what ``shift_mode: resolution`` is linear in)."""
    space = latent_shape[1:]
    frames = space[0] if len(space) == 3 else 1
    return frames * (space[-2] // patch) * (space[-1] // patch)


# ------------------------------------------------------------------ training
def model_inputs(batch: dict[str, Any]) -> dict[str, jax.Array]:
    """The arrays a step needs, as float32 ``jax.Array`` s (a bf16 batch is cast on the device)."""
    names = ("latents", "latents_std", "prompt_embeds", "pooled_prompt_embeds")
    return {k: jnp.asarray(batch[k]).astype(jnp.float32) for k in names if k in batch}


def make_train_step(model: DiT, tx: optax.GradientTransformation, obj: Objective) -> Callable:
    """The ``jax.jit`` train step: (params, opt_state, inputs, key) -> (params, opt_state, loss)."""

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, inputs: dict[str, jax.Array], key: jax.Array):
        latents = inputs["latents"]
        k_eps, k_sigma, k_noise = jax.random.split(key, 3)
        if "latents_std" in inputs:  # a fresh draw from the cached posterior each time
            latents = latents + inputs["latents_std"] * jax.random.normal(k_eps, latents.shape, latents.dtype)
        shift = shift_for(obj, token_count(latents.shape, model.cfg.patch))  # static: shapes are
        sigmas = sample_sigmas(k_sigma, latents.shape[0], obj, shift)
        noise = jax.random.normal(k_noise, latents.shape, latents.dtype)
        s = _per_sample(sigmas, latents)
        noisy = (1.0 - s) * latents + s * noise

        def loss_fn(p):
            pred = model.apply(p, noisy, sigmas, inputs["prompt_embeds"], inputs.get("pooled_prompt_embeds"))
            return flow_matching_loss(pred, latents, noise)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def init_model(cfg: DiTConfig, batch: dict[str, Any], seed: int = 0) -> tuple[DiT, Any]:
    """The model and its parameters, initialised from ``seed`` for the shapes of ``batch``."""
    model = DiT(cfg)
    inputs = model_inputs(batch)
    params = model.init(jax.random.PRNGKey(seed), inputs["latents"], jnp.zeros(len(inputs["latents"])),
                        inputs["prompt_embeds"], inputs.get("pooled_prompt_embeds"))
    return model, params


@dataclass
class TrainResult:
    """What ``train`` did: the model and its trained parameters, the loss of every step, the step timing."""

    model: DiT
    params: Any
    losses: list[float]
    step_timing: dict[str, Any]  # steady_state's figures of a step (its batch read included; first call: compile)
    loader_state: dict[str, Any]
    first_batch: dict[str, Any]


def train(snapshot: str | Path, steps: int, *, batch_size: int = 4, seed: int = 0, learning_rate: float = 1e-3,
          cfg: DiTConfig = DiTConfig(), obj: Objective = Objective(), dtype: str | None = None,
          drop_last: bool = True) -> TrainResult:
    """Train for ``steps`` optimizer steps on ``snapshot`` (a snapshot folder, a cache or an output_dir).

    ``drop_last`` (default): full batches only, so the step compiles once per bucket, not once per bucket
    and remainder size. ``dtype`` None: the loader hands out the cache's own dtype (bf16 as the cache stage
    writes it on a GPU: half the bytes to move); the step casts to float32 on the device."""
    loader = JaxLatentLoader(resolve_snapshot_dir(snapshot), batch_size, seed=seed, dtype=dtype,
                             drop_last=drop_last)
    batches = iter(loader)
    first = next(batches)
    model, params = init_model(cfg, first, seed)
    tx = optax.adamw(learning_rate, weight_decay=0.0)
    opt_state = tx.init(params)
    step_fn = make_train_step(model, tx, obj)
    base_key = jax.random.PRNGKey(seed + 1)
    losses: list[float] = []
    state = {"params": params, "opt_state": opt_state}

    def one_step(step: int) -> float:
        batch = first if step == 0 else next(batches)
        state["params"], state["opt_state"], loss = step_fn(
            state["params"], state["opt_state"], model_inputs(batch), jax.random.fold_in(base_key, step))
        losses.append(float(loss))  # float() waits for the device: the step's time is inside the call
        return losses[-1]

    timing = steady_state(one_step, steps - 1)
    result = TrainResult(model, state["params"], losses, timing.to_json(), loader.state_dict(), first)
    loader.close()
    return result


# ------------------------------------------------------------------ sampling
def make_sampler(model: DiT, steps: int, obj: Objective = Objective()) -> Callable:
    """One compiled function (params, keys [S, 2], text [S, L, D], pooled [S, P] | None, shape) -> samples
    [S, *shape]: the whole Euler loop from pure noise (sigma 1) to data (sigma 0) as ``jax.lax.fori_loop``,
    ``jax.vmap`` over samples; the sigmas are ``FlowMatchEulerDiscreteScheduler``'s, linear then shifted."""

    @partial(jax.jit, static_argnames=("shape",))
    def sample(params, keys: jax.Array, text_SLD: jax.Array, pooled_SP: jax.Array | None, shape: tuple[int, ...]):
        shift = shift_for(obj, token_count((1, *shape), model.cfg.patch))
        sigmas = shift_sigmas(jnp.linspace(1.0, 0.0, steps + 1, dtype=jnp.float32), shift)

        def one(key, text_LD, pooled_P):
            def euler(i, x):
                v = model.apply(params, x[None], sigmas[i][None], text_LD[None],
                                None if pooled_P is None else pooled_P[None])[0]
                return x + (sigmas[i + 1] - sigmas[i]) * v

            return jax.lax.fori_loop(0, steps, euler, jax.random.normal(key, shape, jnp.float32))

        return jax.vmap(one)(keys, text_SLD, pooled_SP)

    return sample


def sample_keys(seed: int, count: int) -> jax.Array:
    """``count`` sampling keys from ``seed`` (one per sample)."""
    return jax.random.split(jax.random.PRNGKey(seed), count)


# ------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("snapshot", type=Path, help="a snapshot folder, a cache folder, or an output_dir (its latest)")
    p.add_argument("--out", type=Path, default=None, help="write summary.json and samples.npy here")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--shift", type=float, default=1.0)
    p.add_argument("--shift-mode", choices=["fixed", "resolution"], default="fixed")
    p.add_argument("--sample-steps", type=int, default=8, help="Euler steps of the sampler (default 8)")
    p.add_argument("--samples", type=int, default=4, help="samples drawn with the snapshot's first prompts")
    p.add_argument("--repeat", type=int, default=3, help="timed sampler calls after the first (default 3)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


@dataclass
class Run:
    """What ``run`` did: its JSON summary, the trained model and the compiled sampler (for reuse)."""

    summary: dict[str, Any]
    result: TrainResult
    sampler: Callable
    samples: np.ndarray


def run(args: argparse.Namespace) -> Run:
    """Train, then draw ``--samples`` samples with the first batch's prompts; time both without warm-up."""
    cfg = DiTConfig(width=args.width, depth=args.depth)
    obj = Objective(shift=args.shift, shift_mode=args.shift_mode)
    start = time.perf_counter()
    result = train(args.snapshot, args.steps, batch_size=args.batch, seed=args.seed, learning_rate=args.lr,
                   cfg=cfg, obj=obj)
    train_s = time.perf_counter() - start

    first = model_inputs(result.first_batch)
    count = min(args.samples, len(first["latents"]))
    shape = tuple(first["latents"].shape[1:])
    text, pooled = first["prompt_embeds"][:count], first.get("pooled_prompt_embeds")
    pooled = None if pooled is None else pooled[:count]
    sampler = make_sampler(result.model, args.sample_steps, obj)
    sampling = steady_state(
        lambda i: sampler(result.params, sample_keys(args.seed + i, count), text, pooled, shape).block_until_ready(),
        args.repeat)
    samples = np.asarray(sampling.results[0])
    tail = max(1, len(result.losses) // 5)
    summary = {
        "snapshot": str(resolve_snapshot_dir(args.snapshot)),
        "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
        "model": asdict(cfg), "objective": asdict(obj), "steps": args.steps, "batch_size": args.batch,
        "loss_first": float(np.mean(result.losses[:tail])), "loss_last": float(np.mean(result.losses[-tail:])),
        "losses": result.losses, "train_s": train_s,
        "train_step": {**result.step_timing, "samples_per_s": (args.batch / result.step_timing["median_s"]
                                                               if result.step_timing["median_s"] else None)},
        "sampler": {**sampling.to_json(), "sample_shape": list(samples.shape), "steps": args.sample_steps,
                    "images_per_s": sampling.per_second(count)},
        "loader_state": result.loader_state,
    }
    print(f"loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f} over {args.steps} steps; "
          f"train step: first call {result.step_timing['first_call_s']:.2f} s (compile), median "
          f"{result.step_timing['median_s'] or float('nan'):.4f} s; sampler ({args.sample_steps} steps, "
          f"{count} samples): first call {sampling.first_s:.2f} s, median {sampling.median_s or float('nan'):.4f} s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        np.save(args.out / "samples.npy", samples)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return Run(summary, result, sampler, samples)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line: ``run`` with ``argv``'s arguments; returns the summary."""
    return run(parse_args(argv)).summary


if __name__ == "__main__":
    main()
