"""The benchmark model zoo: training steps from `jaxpar.models`, with logical axis names.

Before: nothing but the model modules. After: `build(name, preset)` returns a `BenchModel`, a
training step `step(params, opt_state, *batch) -> (params, opt_state, loss)` (Adam), its
arguments as ShapeDtypeStructs (planning and compiling need no memory), `make_args(seed)` for
concrete arguments of those shapes (numpy draws), and `logical(path, shape)`: a logical axis
name for each dimension of every argument leaf, MaxText style ("batch", "embed", "mlp",
"heads", "vocab", "expert", or None), from which `baselines.py` writes the hand-written
layouts.

Models (`PRESETS`): an 8-layer MLP (widths alternate d and ffn), a GPT, a top-2 MoE layer with 8
experts, a ViT. "full" holds the sizes of the issue (MLP d 1024 / ffn 4096; GPT 4 layers at
d 512 / seq 256 and d 2048 / seq 1024; MoE d 1024 / ffn 4096; ViT-Base width at 224 px, 4
layers); "quick" the same with 2-layer GPT and ViT (compile time grows with depth, not
width); "small" the same families at sizes 8 CPU devices run in well under a second a step
(for wall-clock runs); "deep" small's GPT and ViT at 8 layers (planning a deep step:
search_gap.py); "tiny" the smallest that still exercise every layout (tests).
Compiling takes about as long at any size: what costs is the number of ops.

    model = build("gpt-512")
    step, args = model.step, model.args
    concrete = model.make_args(0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.ir import leaf_paths
from jaxpar.models import gpt, mlp, moe, vit

Logical = tuple[str | None, ...]


@dataclass(frozen=True)
class BenchModel:
    """One training step to plan, with what the hand-written baselines need to know about it."""

    name: str
    description: str
    step: Callable                           # (params, opt_state, *batch) -> (params, opt, loss)
    args: tuple                              # ShapeDtypeStructs: params, opt_state, *batch
    arg_names: tuple[str, ...]               # names of args, the first two "params", "opt_state"
    logical: Callable[[str, tuple[int, ...]], Logical]   # leaf path, shape -> axis names
    heads: int | None = None                 # attention heads (Megatron cuts them); None: none
    labels: int = 1                          # integer batch inputs lie in [0, labels)

    def leaves(self) -> list[tuple[str, tuple[int, ...]]]:
        """(path, shape) of every argument leaf, in flattening order ("params/blocks/0/...")."""
        paths = [p for n, a in zip(self.arg_names, self.args, strict=True)
                 for p in leaf_paths(a, n)]
        shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(self.args)]
        return list(zip(paths, shapes, strict=True))

    def make_args(self, seed: int = 0) -> tuple:
        """Concrete arguments shaped like `args`, drawn with numpy (nothing compiles).

        Weights are normal with variance 1 / fan-in (all dimensions but the last), vectors
        normal with std 0.02, optimizer state zero (what Adam's init gives), float batch inputs
        standard normal and integer ones uniform in [0, labels).
        """
        rng = np.random.default_rng(seed)
        leaves = [_draw(rng, path, x, self.labels) for (path, _), x in
                  zip(self.leaves(), jax.tree_util.tree_leaves(self.args), strict=True)]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.args),
                                            [jnp.asarray(v) for v in leaves])


def _draw(rng: np.random.Generator, path: str, x, labels: int) -> np.ndarray:
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    if path.startswith("opt_state/"):
        return np.zeros(shape, dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, labels, shape).astype(dtype)
    if not path.startswith("params/"):
        return rng.standard_normal(shape).astype(dtype)
    std = np.prod(shape[:-1]) ** -0.5 if len(shape) > 1 else 0.02
    return (rng.standard_normal(shape) * std).astype(dtype)


# ---- logical axis names per parameter (MaxText's logical annotations, as data) ---------------

_TRANSFORMER: dict[str, Logical] = {
    "wqkv": ("embed", "heads"), "bqkv": ("heads",), "wo": ("heads", "embed"), "bo": ("embed",),
    "w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed"), "b2": ("embed",),
    "scale": ("embed",), "bias": ("embed",), "wte": ("vocab", "embed"), "wpe": (None, "embed"),
    "pos": (None, "embed"), "patch/kernel": (None, None, None, "embed"),
    "head/w": ("embed", "vocab"), "head/b": ("vocab",)}
_MOE: dict[str, Logical] = {
    "router": ("embed", None), "w1": ("expert", "embed", "mlp"), "b1": ("expert", "mlp"),
    "w2": ("expert", "mlp", "embed"), "b2": ("expert", "embed")}


def _batch_or_scalar(path: str, shape: tuple[int, ...]) -> Logical | None:
    if not shape:
        return ()
    if not path.startswith(("params/", "opt_state/")):
        return ("batch",) + (None,) * (len(shape) - 1)
    return None


def _table_logical(table: dict[str, Logical]) -> Callable[[str, tuple[int, ...]], Logical]:
    """logical(path, shape) from a table keyed by the last one or two path components."""
    def logical(path: str, shape: tuple[int, ...]) -> Logical:
        fixed = _batch_or_scalar(path, shape)
        if fixed is not None:
            return fixed
        parts = path.split("/")
        names = table.get("/".join(parts[-2:])) or table.get(parts[-1])
        assert names is not None and len(names) == len(shape), f"no logical axes for {path}"
        return names
    return logical


def _mlp_logical(path: str, shape: tuple[int, ...]) -> Logical:
    """Layer i maps d -> ffn when i is even and ffn -> d when odd (`params/3/w`)."""
    fixed = _batch_or_scalar(path, shape)
    if fixed is not None:
        return fixed
    index, leaf = path.split("/")[-2:]
    wide = int(index) % 2 == 0
    if leaf == "w":
        return ("embed", "mlp") if wide else ("mlp", "embed")
    return ("mlp",) if wide else ("embed",)


# ---- the models --------------------------------------------------------------------------------

def mlp_model(d: int = 1024, ffn: int = 4096, layers: int = 8, batch: int = 256) -> BenchModel:
    """An MLP of `layers` dense layers with widths d, ffn, d, ... d; squared loss; Adam."""
    sizes = [d if i % 2 == 0 else ffn for i in range(layers + 1)]
    sizes[-1] = d
    tx = optax.adam(1e-3)
    params = jax.eval_shape(lambda: mlp.init_mlp(jax.random.key(0), sizes))
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)
    args = (params, jax.eval_shape(tx.init, params), x, x)
    return BenchModel("mlp", f"MLP {layers} layers, d {d}, ffn {ffn}, batch {batch}",
                      mlp.make_train_step(tx), args, ("params", "opt_state", "x", "y"),
                      _mlp_logical)


def gpt_model(layers: int = 4, d_model: int = 512, heads: int = 8, vocab: int = 8192,
              seq: int = 256, batch: int = 16, name: str = "gpt") -> BenchModel:
    """The GPT of `jaxpar.models.gpt` (tied embedding, Adam)."""
    cfg = gpt.GPTConfig(layers=layers, d_model=d_model, heads=heads, vocab=vocab, seq=seq)
    step, args = gpt.abstract_train_step(cfg, batch)
    return BenchModel(name, f"GPT {layers} layers, d {d_model}, {heads} heads, vocab {vocab}, "
                      f"seq {seq}, batch {batch}", step, args,
                      ("params", "opt_state", "tokens", "targets"),
                      _table_logical(_TRANSFORMER), heads, vocab)


def moe_model(d_model: int = 1024, d_ff: int = 4096, experts: int = 8, group_size: int = 256,
              groups: int = 16) -> BenchModel:
    """One top-2 MoE layer (`jaxpar.models.moe`) trained with Adam."""
    cfg = moe.MoEConfig(d_model=d_model, d_ff=d_ff, experts=experts, group_size=group_size)
    step, args = moe.abstract_train_step(cfg, groups)
    return BenchModel("moe", f"MoE top-2, {experts} experts, d {d_model}, ffn {d_ff}, "
                      f"{groups} groups x {group_size} tokens, capacity {cfg.capacity}", step,
                      args, ("params", "opt_state", "x", "y"), _table_logical(_MOE))


def vit_model(image: int = 224, patch: int = 16, d_model: int = 768, heads: int = 12,
              layers: int = 4, classes: int = 1000, batch: int = 32) -> BenchModel:
    """The ViT of `jaxpar.models.vit` (conv patch embedding, Adam)."""
    cfg = vit.ViTConfig(image=image, patch=patch, d_model=d_model, heads=heads, layers=layers,
                        classes=classes)
    step, args = vit.abstract_train_step(cfg, batch)
    return BenchModel("vit", f"ViT {layers} layers, {image} px / {patch}, d {d_model}, "
                      f"{heads} heads, {classes} classes, batch {batch}", step, args,
                      ("params", "opt_state", "images", "labels"),
                      _table_logical(_TRANSFORMER), heads, classes)


# preset -> model name -> (builder, keyword arguments)
PRESETS: dict[str, dict[str, tuple[Callable[..., BenchModel], dict]]] = {
    "full": {
        "mlp": (mlp_model, {}),
        "gpt-512": (gpt_model, {"d_model": 512, "heads": 8, "seq": 256, "name": "gpt-512"}),
        "gpt-2048": (gpt_model, {"d_model": 2048, "heads": 16, "seq": 1024,
                                 "name": "gpt-2048"}),
        "moe": (moe_model, {}),
        "vit": (vit_model, {}),
    },
    "quick": {
        "mlp": (mlp_model, {}),
        "gpt": (gpt_model, {"layers": 2, "d_model": 512, "heads": 8, "seq": 256}),
        "moe": (moe_model, {}),
        "vit": (vit_model, {"layers": 2}),
    },
    "small": {
        "mlp": (mlp_model, {"d": 256, "ffn": 1024, "batch": 64}),
        "gpt": (gpt_model, {"layers": 2, "d_model": 256, "heads": 8, "vocab": 2048, "seq": 128}),
        "moe": (moe_model, {"d_model": 256, "d_ff": 1024, "group_size": 64, "groups": 16}),
        "vit": (vit_model, {"image": 32, "patch": 4, "d_model": 128, "heads": 4, "layers": 2,
                            "classes": 10, "batch": 16}),
    },
    "deep": {
        "gpt": (gpt_model, {"layers": 8, "d_model": 256, "heads": 8, "vocab": 2048, "seq": 128}),
        "vit": (vit_model, {"image": 32, "patch": 4, "d_model": 128, "heads": 4, "layers": 8,
                            "classes": 10, "batch": 16}),
    },
    "tiny": {
        "mlp": (mlp_model, {"d": 32, "ffn": 64, "layers": 2, "batch": 16}),
        "gpt": (gpt_model, {"layers": 1, "d_model": 32, "heads": 4, "vocab": 64, "seq": 8,
                            "batch": 8}),
        "moe": (moe_model, {"d_model": 16, "d_ff": 32, "group_size": 8, "groups": 8}),
        "vit": (vit_model, {"image": 8, "patch": 4, "d_model": 16, "heads": 2, "layers": 1,
                            "classes": 4, "batch": 8}),
    },
}


def build(name: str, preset: str = "full") -> BenchModel:
    """The benchmark model `name` at the sizes of `preset`.

    Args:
      name: a model of the preset (`list(PRESETS[preset])`).
      preset: which sizes: "full", "quick", "small", "deep" or "tiny".

    Returns:
      A BenchModel.

    Example:
      >>> build("mlp", "tiny").description
      'MLP 2 layers, d 32, ffn 64, batch 16'
    """
    if preset not in PRESETS:
        raise ValueError(f"build(preset={preset!r}): use one of {list(PRESETS)}.")
    if name not in PRESETS[preset]:
        raise ValueError(f"build(name={name!r}): preset {preset!r} has the models "
                         f"{list(PRESETS[preset])}.")
    builder, kwargs = PRESETS[preset][name]
    return builder(**kwargs)
