"""A decoder-only transformer language model over bytes, in plain JAX, with optax AdamW.

Nothing here knows about the sidecar: any trainer (this directory's ``train.py``, a
Grain + Orbax baseline) builds the same state and runs the same step::

  config = model.CONFIGS["tiny"]
  optimizer = model.make_optimizer(config)
  state = model.init_state(config, optimizer, seed=0)
  train_step = model.make_train_step(config, optimizer)
  state, loss = train_step(state, {"tokens": tokens})  # int32[batch, seq_len + 1]

The state is a pytree ``{"step": int32[], "params": {...}, "opt": optax state}``;
``state["step"]`` counts the updates applied (1 after the first step). Parameters are
float32; ``Config.compute_dtype`` is what the matmuls run in. Layers are stacked on a
leading axis and run with ``lax.scan``, so the program (and its compile time) does not
grow with depth.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

VOCAB_SIZE = 256  # byte tokens
# Norm scales and biases take no weight decay.
_NO_DECAY = frozenset({"attn_norm", "mlp_norm", "final_norm"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
  """A model, its optimizer and its batch shape."""
  seq_len: int
  batch_size: int  # global: every step's sequences over all devices
  d_model: int
  n_layers: int
  n_heads: int
  d_ff: int = 0  # 0: 4 * d_model
  vocab_size: int = VOCAB_SIZE
  learning_rate: float = 3e-4
  warmup_steps: int = 100
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  compute_dtype: str = "float32"
  remat: bool = False  # recompute each layer's activations in the backward pass

  def __post_init__(self):
    for name in ("seq_len", "batch_size", "d_model", "n_layers", "n_heads", "vocab_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model must be a multiple of n_heads, got d_model={self.d_model}, "
                       f"n_heads={self.n_heads}")
    if self.d_ff == 0:
      object.__setattr__(self, "d_ff", 4 * self.d_model)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


CONFIGS = {
    # A few seconds per 100 steps on 2 CPU cores: tests and laptops.
    "tiny": Config(seq_len=64, batch_size=8, d_model=64, n_layers=2, n_heads=4,
                   learning_rate=3e-3, warmup_steps=20),
    # ~12.7M parameters, params + Adam moments ~150 MB in float32, about a second a step on
    # 2 CPU cores: the save and recovery paths at a size that takes time on CPU.
    "cpu": Config(seq_len=64, batch_size=8, d_model=512, n_layers=4, n_heads=8,
                  learning_rate=3e-4, warmup_steps=20),
    # One TPU v5e (15.7 GiB HBM): ~101M parameters, params + Adam moments ~1.2 GB in float32;
    # bf16 matmuls; remat keeps 8 layers' attention activations out of memory.
    "chip": Config(seq_len=512, batch_size=32, d_model=1024, n_layers=8, n_heads=16,
                   learning_rate=3e-4, warmup_steps=200, compute_dtype="bfloat16", remat=True),
}


def init_params(config: Config, key: jax.Array) -> dict[str, Any]:
  """Fresh float32 parameters: normal(0.02) matrices, unit norm scales."""
  d, f, h, hd, n = config.d_model, config.d_ff, config.n_heads, config.head_dim, config.n_layers
  keys = iter(jax.random.split(key, 7))

  def normal(shape, std=0.02):
    return std * jax.random.normal(next(keys), shape, jnp.float32)

  out_std = 0.02 / math.sqrt(2 * n)  # residual projections, as GPT-2
  return {
      "embed": normal((config.vocab_size, d)),
      "pos": normal((config.seq_len, d), 0.01),
      "layers": {
          "attn_norm": jnp.ones((n, d), jnp.float32),
          "wqkv": normal((n, d, 3, h, hd)),
          "wo": normal((n, h, hd, d), out_std),
          "mlp_norm": jnp.ones((n, d), jnp.float32),
          "w1": normal((n, d, f)),
          "w2": normal((n, f, d), out_std),
      },
      "final_norm": jnp.ones((d,), jnp.float32),
      "unembed": normal((d, config.vocab_size)),
  }


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (normed * scale).astype(x.dtype)


def _layer(config: Config, x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  dtype = jnp.dtype(config.compute_dtype)
  t = x.shape[1]
  h = _rms_norm(x, p["attn_norm"])
  q, k, v = jnp.unstack(jnp.einsum("btd,dkhe->kbthe", h, p["wqkv"].astype(dtype)), axis=0)
  logits = jnp.einsum("bqhe,bkhe->bhqk", q, k).astype(jnp.float32) / math.sqrt(config.head_dim)
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  weights = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(dtype)
  attn = jnp.einsum("bhqk,bkhe->bqhe", weights, v)
  x = x + jnp.einsum("bqhe,hed->bqd", attn, p["wo"].astype(dtype))
  h = _rms_norm(x, p["mlp_norm"])
  h = jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["w1"].astype(dtype)))
  return x + jnp.einsum("btf,fd->btd", h, p["w2"].astype(dtype))


def forward(config: Config, params: dict[str, Any], inputs: jax.Array) -> jax.Array:
  """float32 logits ``[batch, time, vocab]`` of int ``inputs`` ``[batch, time]``."""
  dtype = jnp.dtype(config.compute_dtype)
  x = (params["embed"][inputs] + params["pos"][:inputs.shape[1]]).astype(dtype)
  layer = lambda x, p: (_layer(config, x, p), None)
  if config.remat:
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  x, _ = jax.lax.scan(layer, x, params["layers"])
  x = _rms_norm(x, params["final_norm"])
  return jnp.einsum("btd,dv->btv", x, params["unembed"].astype(dtype)).astype(jnp.float32)


def loss_fn(config: Config, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy (nats) over ``tokens`` ``[batch, seq_len + 1]``."""
  logits = forward(config, params, tokens[:, :-1])
  targets = tokens[:, 1:]
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_optimizer(config: Config) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and a linear warmup to a constant rate."""
  lr = config.learning_rate
  schedule = lambda count: lr * jnp.minimum(1.0, (count + 1) / config.warmup_steps)
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: not _NO_DECAY.intersection(getattr(k, "key", None) for k in path),
      params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
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

  ``batch`` is ``{"tokens": int32[batch_size, seq_len + 1]}``; ``loss`` is the float32
  mean loss of that batch under the parameters before the update. With shardings given
  (e.g. state replicated, batch split over a "data" axis), the new state keeps the
  state's sharding and the loss is replicated.
  """
  def step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(config, p, batch["tokens"]))(
        state["params"])
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"step": state["step"] + 1, "params": params, "opt": opt}, loss

  if state_sharding is None:
    return jax.jit(step, donate_argnums=0)
  replicated = jax.sharding.NamedSharding(state_sharding.mesh, jax.sharding.PartitionSpec())
  return jax.jit(step, donate_argnums=0, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, replicated))


def param_count(tree: Any) -> int:
  """Elements of every leaf of ``tree`` (parameters, or a whole state)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def state_bytes(tree: Any) -> int:
  """Bytes of every leaf of ``tree``."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
