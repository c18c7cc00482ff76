"""A Vision Transformer classifier, in plain JAX, with optax AdamW.

Nothing here knows about the sidecar: any trainer (this directory's ``train.py``, its
Grain baseline, the device-resident bound in ``benchmarks.vision``) builds the same state
and runs the same step::

  config = model.CONFIGS["tiny"]
  optimizer = model.make_optimizer(config)
  state = model.init_state(config, optimizer, seed=0)
  train_step = model.make_train_step(config, optimizer)
  state, loss = train_step(state, {"image": uint8[b, s, s, 3], "label": int32[b]})

Images arrive as uint8 and are normalized here, on the device (``pipelines.images.MEAN``
and ``STD``): a batch crosses to the accelerator in a quarter of float32's bytes. The
image is cut into ``patch`` x ``patch`` patches, each embedded, a class token and learned
positions added; pre-norm transformer layers (stacked on a leading axis and run with
``lax.scan``, so compile time does not grow with depth); the class token's output
classifies. The state is ``{"step": int32[], "params": {...}, "opt": optax state}``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

# ImageNet's per-channel mean and standard deviation (pipelines.images.MEAN, STD): here
# too, so that the model needs nothing of the pipelines.
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
_NO_DECAY = frozenset({"attn_norm", "mlp_norm", "final_norm", "b_embed", "b_head"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
  """A model, its optimizer and its batch shape."""
  image_size: int
  patch: int
  batch_size: int  # global
  d_model: int
  n_layers: int
  n_heads: int
  num_classes: int = 10
  d_ff: int = 0  # 0: 4 * d_model
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  weight_decay: float = 0.05
  grad_clip: float = 1.0
  compute_dtype: str = "float32"
  remat: bool = False

  def __post_init__(self):
    for name in ("image_size", "patch", "batch_size", "d_model", "n_layers", "n_heads",
                 "num_classes"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
    if self.image_size % self.patch:
      raise ValueError(f"image_size must be a multiple of patch, got image_size="
                       f"{self.image_size}, patch={self.patch}")
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model must be a multiple of n_heads, got d_model={self.d_model}, "
                       f"n_heads={self.n_heads}")
    if self.d_ff == 0:
      object.__setattr__(self, "d_ff", 4 * self.d_model)

  @property
  def tokens(self) -> int:
    return (self.image_size // self.patch) ** 2 + 1  # the patches and the class token

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def train_flops(self) -> float:
    """FLOPs of one training step (forward and backward: 3x the forward's matmuls)."""
    t, d, f, n = self.tokens, self.d_model, self.d_ff, self.n_layers
    per_layer = 2 * t * d * 3 * d + 2 * 2 * t * t * d + 2 * t * d * d + 2 * 2 * t * d * f
    embed = 2 * (t - 1) * self.patch * self.patch * 3 * d
    return 3 * self.batch_size * (n * per_layer + embed + 2 * d * self.num_classes)


CONFIGS = {
    # Seconds for a few dozen steps on 2 CPU cores: tests and laptops (32x32 crops).
    "tiny": Config(image_size=32, patch=8, batch_size=8, d_model=32, n_layers=2, n_heads=2,
                   learning_rate=3e-3, warmup_steps=10),
    # One TPU v5e: ViT-B/16 at 224x224 (86M parameters, ~17.6 GFLOPs an image forward),
    # bf16 matmuls, 128 images a step: several hundred to a thousand images a second
    # wanted. The attention weights are recomputed in the backward pass (remat), so 12
    # layers of 128 images' attention stay out of the chip's 15.7 GiB.
    "chip": Config(image_size=224, patch=16, batch_size=128, d_model=768, n_layers=12,
                   n_heads=12, learning_rate=1e-3, warmup_steps=200,
                   compute_dtype="bfloat16", remat=True),
}


def init_params(config: Config, key: jax.Array) -> dict[str, Any]:
  """Fresh float32 parameters."""
  d, f, h, hd, n = config.d_model, config.d_ff, config.n_heads, config.head_dim, config.n_layers
  keys = iter(jax.random.split(key, 8))
  p = config.patch * config.patch * 3

  def normal(shape, std):
    return std * jax.random.truncated_normal(next(keys), -2.0, 2.0, shape, jnp.float32)

  return {
      "w_embed": normal((p, d), 1 / math.sqrt(p)),
      "b_embed": jnp.zeros((d,), jnp.float32),
      "cls": normal((1, 1, d), 0.02),
      "pos": normal((config.tokens, d), 0.02),
      "layers": {
          "attn_norm": jnp.ones((n, d), jnp.float32),
          "wqkv": normal((n, d, 3, h, hd), 1 / math.sqrt(d)),
          "wo": normal((n, h, hd, d), 1 / math.sqrt(d) / math.sqrt(2 * n)),
          "mlp_norm": jnp.ones((n, d), jnp.float32),
          "w1": normal((n, d, f), 1 / math.sqrt(d)),
          "w2": normal((n, f, d), 1 / math.sqrt(f) / math.sqrt(2 * n)),
      },
      "final_norm": jnp.ones((d,), jnp.float32),
      "w_head": jnp.zeros((d, config.num_classes), jnp.float32),
      "b_head": jnp.zeros((config.num_classes,), jnp.float32),
  }


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (normed * scale).astype(x.dtype)


def _layer(config: Config, x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  dtype = jnp.dtype(config.compute_dtype)
  h = _norm(x, p["attn_norm"])
  q, k, v = jnp.unstack(jnp.einsum("btd,dkhe->kbthe", h, p["wqkv"].astype(dtype)), axis=0)
  logits = jnp.einsum("bqhe,bkhe->bhqk", q, k).astype(jnp.float32) / math.sqrt(config.head_dim)
  weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
  attn = jnp.einsum("bhqk,bkhe->bqhe", weights, v)
  x = x + jnp.einsum("bqhe,hed->bqd", attn, p["wo"].astype(dtype))
  h = _norm(x, p["mlp_norm"])
  h = jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["w1"].astype(dtype)))
  return x + jnp.einsum("btf,fd->btd", h, p["w2"].astype(dtype))


def patches(config: Config, images: jax.Array) -> jax.Array:
  """uint8 ``images`` [b, s, s, 3] as normalized float patches [b, (s/p)^2, p*p*3]."""
  b, s, p = images.shape[0], config.image_size, config.patch
  x = (images.astype(jnp.float32) - jnp.asarray(MEAN)) / jnp.asarray(STD)
  x = x.reshape(b, s // p, p, s // p, p, 3).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (s // p) ** 2, p * p * 3)


def forward(config: Config, params: dict[str, Any], images: jax.Array) -> jax.Array:
  """float32 logits ``[batch, num_classes]`` of uint8 ``images`` ``[batch, s, s, 3]``."""
  dtype = jnp.dtype(config.compute_dtype)
  x = patches(config, images).astype(dtype) @ params["w_embed"].astype(dtype)
  x = x + params["b_embed"].astype(dtype)
  cls = jnp.broadcast_to(params["cls"].astype(dtype), (x.shape[0], 1, x.shape[2]))
  x = jnp.concatenate([cls, x], axis=1) + params["pos"].astype(dtype)
  layer = lambda x, p: (_layer(config, x, p), None)
  if config.remat:
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  x, _ = jax.lax.scan(layer, x, params["layers"])
  x = _norm(x[:, 0], params["final_norm"]).astype(jnp.float32)
  return x @ params["w_head"] + params["b_head"]


def loss_fn(config: Config, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
  """Mean cross-entropy (nats) of the batch's labels."""
  logits = forward(config, params, batch["image"])
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, batch["label"][:, None], axis=-1))


def make_optimizer(config: Config) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and a linear warmup to a constant rate."""
  lr = config.learning_rate
  schedule = lambda count: lr * jnp.minimum(1.0, (count + 1) / config.warmup_steps)
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: not _NO_DECAY.intersection(getattr(k, "key", None) for k in path),
      params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=config.weight_decay,
                  mask=decay_mask))


def init_state(config: Config, optimizer: optax.GradientTransformation, *, seed: int = 0,
               sharding: jax.sharding.Sharding | None = None) -> dict[str, Any]:
  """A fresh training state, made on the devices of ``sharding`` (e.g. replicated)."""
  def init():
    params = init_params(config, jax.random.key(seed))
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt": optimizer.init(params)}
  return jax.jit(init, out_shardings=sharding)()


def abstract_state(config: Config, optimizer: optax.GradientTransformation, *,
                   sharding: jax.sharding.Sharding | None = None) -> dict[str, Any]:
  """The state's shapes and dtypes (with ``sharding`` on every leaf): a restore target."""
  shapes = jax.eval_shape(lambda: init_state(config, optimizer))
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                      shapes)


def make_train_step(config: Config, optimizer: optax.GradientTransformation, *,
                    state_sharding: Any = None, batch_sharding: Any = None):
  """The jitted ``train_step(state, batch) -> (state, loss)``; it donates ``state``.

  ``batch`` is ``{"image": uint8[batch_size, s, s, 3], "label": int32[batch_size]}``;
  ``loss`` is the batch's mean loss under the parameters before the update.
  """
  def step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(config, p, batch))(state["params"])
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"step": state["step"] + 1, "params": params, "opt": opt}, loss

  if state_sharding is None:
    return jax.jit(step, donate_argnums=0)
  replicated = jax.sharding.NamedSharding(state_sharding.mesh, jax.sharding.PartitionSpec())
  return jax.jit(step, donate_argnums=0, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, replicated))


def param_count(tree: Any) -> int:
  """Elements of every leaf of ``tree``."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
