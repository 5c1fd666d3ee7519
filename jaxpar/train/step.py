"""A training step from a loss and an optax optimizer: gradient accumulation and gradients_mean.

Before: `loss_fn(params, *batch)` returning the mean loss over its batch (or `(loss, aux)`), and
an `optax.GradientTransformation`. After: a plain function `step(params, opt_state, *batch)` that
`jax.jit` or `jaxpar.shard` compiles, doing one optimizer update per call.

MindSpore context keys this implements:
  - `grad_accumulation_step` k: the batch is cut into k microbatches; a `lax.scan` sums their
    losses and gradients in float32 at least (half precision ones in float32, the fp32
    accumulation buffer MindSpore keeps for `gradient_fp32_sync`; float64 and complex ones in
    their own dtype), divides by k, and the optimizer runs once. For a
    mean loss the result equals the full-batch step.
  - `gradients_mean`: True gives the gradient of the global mean loss (as on one device). False is
    MindSpore's data-parallel sum without the mean: each replica's mean-loss gradient summed over
    the `data_parallel` replicas, i.e. the mean-loss gradient times `data_parallel`.

Known gap: with the batch sharded over D replicas, the partitioner all-reduces each microbatch's
gradient inside the scan (k gradient all-reduces per step, measured under jax.jit on 8 CPU
devices), where MindSpore accumulates locally and reduces once per step.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.context import current_context

MICROBATCH_LAYOUTS = ("strided", "contiguous")


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, *,
                    grad_accumulation_step: int | None = None, gradients_mean: bool = True,
                    data_parallel: int = 1, has_aux: bool = False,
                    batch_argnums: int | Sequence[int] | None = None,
                    microbatch_layout: str = "strided") -> Callable:
    """A training step `step(params, opt_state, *batch) -> (params, opt_state, loss[, aux])`.

    Args:
      loss_fn: `loss_fn(params, *batch)` -> the mean loss over the batch (a scalar), or
        `(loss, aux)` with `has_aux=True`.
      optimizer: an optax GradientTransformation (anything with `init` and `update`).
      grad_accumulation_step: k >= 1 microbatches per step (MindSpore's key of that name). The
        leading dim of every batched argument must divide by k; one optimizer update per step.
        None: the parallel context's `grad_accumulation_step` (default 1).
      gradients_mean: True (default): gradients of the global mean loss, as on one device.
        False: MindSpore's data-parallel gradients without the mean, the sum over the
        `data_parallel` replicas of each replica's mean-loss gradient = gradients * data_parallel.
        The returned loss is the global mean either way.
      data_parallel: the number of data-parallel replicas (>= 1); used only when
        `gradients_mean=False`.
      has_aux: loss_fn returns `(loss, aux)`; the step then returns aux as well (floating aux
        leaves averaged over microbatches, see `accumulate_gradients`).
      batch_argnums: indices into `batch` of the arguments cut into microbatches (their leading
        dim is the batch); None (default) = all of them. The others reach every microbatch whole.
      microbatch_layout: "strided" (default; microbatch j = rows j, j+k, j+2k, ...: keeps each
        microbatch spread over a batch-sharded dimension) or "contiguous" (rows j*B/k ...).

    Returns:
      `step(params, opt_state, *batch)` returning `(params, opt_state, loss)`, or
      `(params, opt_state, loss, aux)` with `has_aux`; loss is float32.

    Example:
      >>> optimizer = optax.adamw(1e-3)
      >>> step = make_train_step(loss_fn, optimizer, grad_accumulation_step=4)
      >>> params, opt_state, loss = jax.jit(step)(params, optimizer.init(params), x, y)
    """
    _check_loss_and_layout(loss_fn, microbatch_layout)
    _check_optimizer(optimizer)
    if grad_accumulation_step is None:
        grad_accumulation_step = current_context().grad_accumulation_step
    k = _positive_int(grad_accumulation_step, "grad_accumulation_step", "e.g. 1 or 4")
    dp = _positive_int(data_parallel, "data_parallel",
                       "the number of data-parallel replicas, e.g. 8")
    _check_bool(gradients_mean, "gradients_mean")
    _check_bool(has_aux, "has_aux")
    argnums = _batch_argnums(batch_argnums)

    def step(params, opt_state, *batch):
        out, grads = accumulate_gradients(loss_fn, params, batch, k, has_aux=has_aux,
                                          batch_argnums=argnums,
                                          microbatch_layout=microbatch_layout)
        if not gradients_mean:  # MindSpore without the mean: the sum over the dp replicas
            grads = jax.tree.map(lambda g: g * dp, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, *out) if has_aux else (params, opt_state, out)

    step.grad_accumulation_step = k  # AutoParallel reads it: the step accumulates itself
    return step


def accumulate_gradients(loss_fn: Callable, params: Any, batch: tuple, k: int, *,
                         has_aux: bool = False, batch_argnums: int | Sequence[int] | None = None,
                         microbatch_layout: str = "strided") -> tuple[Any, Any]:
    """The mean loss and its gradients over `batch`, computed in `k` microbatches.

    With k > 1 a `lax.scan` runs `loss_fn` on each microbatch and sums losses and gradients in
    float32 (float64 and complex ones in their own dtype), then divides by k; gradients come
    back in each parameter's dtype. For a loss that
    is a mean over the batch this equals `jax.value_and_grad(loss_fn)(params, *batch)`.

    Args:
      loss_fn: `loss_fn(params, *batch)` -> mean loss, or `(loss, aux)` with `has_aux`.
      params: the pytree to differentiate.
      batch: a tuple of loss_fn's remaining arguments (arrays or pytrees of arrays).
      k: the number of microbatches (int >= 1).
      has_aux: loss_fn returns `(loss, aux)`. Floating aux leaves are averaged over the
        microbatches (as the gradients, cast back); a non-floating leaf with k > 1 is a
        TypeError.
      batch_argnums: indices into `batch` cut into microbatches; None = all.
      microbatch_layout: "strided" or "contiguous" (see `make_train_step`).

    Returns:
      `(loss, grads)`, or `((loss, aux), grads)` with `has_aux`; loss is a float32 scalar.

    Example:
      >>> loss, grads = accumulate_gradients(loss_fn, params, (x, y), 4)
    """
    _check_loss_and_layout(loss_fn, microbatch_layout)
    k = _positive_int(k, "k", "the number of microbatches, e.g. 4")
    if not isinstance(batch, tuple | list):
        raise TypeError(f"accumulate_gradients(batch={type(batch).__name__}): batch must be a "
                        "tuple of loss_fn's arguments after params, e.g. (x, y) or (x,).")
    batched = _batched_positions(_batch_argnums(batch_argnums), len(batch))
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
    if k == 1:
        out, grads = grad_fn(params, *batch)
        return _as_f32_loss(out, has_aux), grads
    _check_divisible(batch, batched, k)
    split = [split_microbatches(b, k, microbatch_layout) if i in batched else b
             for i, b in enumerate(batch)]
    return _scan_microbatches(grad_fn, params, split, batched, k, has_aux)


def split_microbatches(tree: Any, k: int, layout: str = "strided") -> Any:
    """Every leaf `x` of shape (B, ...) as (k, B // k, ...): microbatch j is `result[j]`.

    Args:
      tree: a pytree of arrays whose leading dim B divides by k.
      k: the number of microbatches.
      layout: "strided": microbatch j = rows j, j+k, j+2k, ...; "contiguous": rows
        j*B/k ... (j+1)*B/k - 1.

    Returns:
      The same pytree with a leading microbatch axis of size k on every leaf.

    Example:
      >>> split_microbatches(jnp.arange(6), 2)        # [[0, 2, 4], [1, 3, 5]]
    """
    if layout not in MICROBATCH_LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {MICROBATCH_LAYOUTS}.")
    k = _positive_int(k, "k", "the number of microbatches split_microbatches makes")
    bad = _undivided(tree, k)
    if bad is not None:
        raise ValueError(f"split_microbatches: tree{bad}; give leaves whose leading (batch) "
                         "dim is a multiple of k.")
    # Why strided: a batch sharded over D devices holds contiguous row blocks per device. Strided
    # (B//k, k) -> swap keeps the B//k axis sharded exactly as the batch was, so each microbatch
    # has B/(k*D) rows on every device and the scan's slicing moves no data. A contiguous
    # (k, B//k) split puts the sharded rows on the microbatch axis: microbatch j lives on D/k
    # devices only, and the scan would gather it (and leave the other devices idle).
    if layout == "strided":
        return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                            tree)
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), tree)


# ---------------------------------------------------------------------------------------------
# The scan over microbatches


def _scan_microbatches(grad_fn: Callable, params, split: list, batched: frozenset[int], k: int,
                       has_aux: bool) -> tuple[Any, Any]:
    order = sorted(batched)

    def body(acc, micro):
        args = list(split)
        for i, m in zip(order, micro, strict=True):
            args[i] = m
        return _accumulate(acc, grad_fn(params, *args)), None

    shapes = jax.eval_shape(grad_fn, params, *_first_microbatch(split, batched))
    total, _ = jax.lax.scan(body, _wide_zeros(shapes), tuple(split[i] for i in order),
                            length=k)
    # Back to the dtypes loss_fn produced, except the loss, which is float32.
    (out, grads), dtypes = jax.tree.map(lambda t: t / k, total), jax.tree.map(_dtype, shapes)
    grads = jax.tree.map(lambda g, d: g.astype(d), grads, dtypes[1])
    if has_aux:
        return (out[0].astype(jnp.float32),
                jax.tree.map(lambda a, d: a.astype(d), out[1], dtypes[0][1])), grads
    return out.astype(jnp.float32), grads


def _dtype(s: jax.ShapeDtypeStruct) -> jnp.dtype:
    return s.dtype


def _first_microbatch(split: list, batched: frozenset[int]) -> list:
    return [jax.tree.map(lambda x: x[0], b) if i in batched else b for i, b in enumerate(split)]


def _wide_zeros(shapes) -> Any:
    """Zeros to sum each (loss, aux, grads) leaf in: its dtype promoted with float32 (bf16 and
    f16 in float32; float64 and complex kept: a complex gradient's imaginary part too); a
    non-floating aux leaf is an error."""
    def zero(path, s):
        if not jnp.issubdtype(s.dtype, jnp.inexact):
            where = "aux" + jax.tree_util.keystr(path[2:])  # path = (out, aux, ...)
            raise TypeError(f"accumulate_gradients: the output {where} has dtype {s.dtype}, "
                            "which cannot be averaged over microbatches; "
                            "return it as a float (e.g. a mean) or use k=1.")
        return jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32))

    return jax.tree_util.tree_map_with_path(zero, shapes)


def _accumulate(acc, new) -> Any:
    return jax.tree.map(lambda a, n: a + n.astype(a.dtype), acc, new)


def _as_f32_loss(out, has_aux: bool):
    if has_aux:
        return out[0].astype(jnp.float32), out[1]
    return out.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Validation


def _check_divisible(batch: tuple, batched: frozenset[int], k: int) -> None:
    for i in sorted(batched):
        bad = _undivided(batch[i], k)
        if bad is not None:
            raise ValueError(f"grad_accumulation_step={k}: batch[{i}]{bad}; use a batch size "
                             f"that is a multiple of {k}, or leave this argument out of "
                             "batch_argnums.")


def _undivided(tree: Any, k: int) -> str | None:
    """The first leaf of `tree` whose leading dim k does not divide (or that has none), said
    as "<its path> of shape <shape> <why>"; None when every leaf splits into k."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(jnp.shape(x))
        if not shape or shape[0] % k:
            problem = ("is a scalar with no batch dim" if not shape else
                       f"has leading dim {shape[0]}, which does not divide by k={k}")
            return f"{jax.tree_util.keystr(path)} of shape {shape} {problem}"
    return None


def _batched_positions(argnums: tuple[int, ...] | None, n: int) -> frozenset[int]:
    if argnums is None:
        return frozenset(range(n))
    for i in argnums:
        if i >= n:
            raise ValueError(f"batch_argnums={argnums!r}: index {i} is out of range for the "
                             f"{n} batch argument(s); use indices 0..{n - 1}.")
    return frozenset(argnums)


def _batch_argnums(argnums) -> tuple[int, ...] | None:
    if argnums is None:
        return None
    nums = (argnums,) if _is_int(argnums) else argnums
    if not isinstance(nums, tuple | list) or not all(_is_int(i) and i >= 0 for i in nums):
        raise TypeError(f"batch_argnums={argnums!r} must be None (every batch argument), a "
                        "non-negative int or a tuple of them, e.g. (0, 1).")
    if len(set(nums)) != len(nums):
        raise ValueError(f"batch_argnums={argnums!r} lists an index twice; give each once.")
    return tuple(int(i) for i in nums)


def _check_loss_and_layout(loss_fn, layout) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} must be callable: loss_fn(params, *batch) -> the "
                        "mean loss over the batch.")
    if layout not in MICROBATCH_LAYOUTS:
        raise ValueError(f"microbatch_layout={layout!r} must be one of {MICROBATCH_LAYOUTS}.")


def _check_optimizer(optimizer) -> None:
    if not all(callable(getattr(optimizer, name, None)) for name in ("init", "update")):
        raise TypeError(f"optimizer={optimizer!r} must be an optax.GradientTransformation (with "
                        "init and update), e.g. optax.adamw(1e-3).")


def _positive_int(value, name: str, hint: str) -> int:
    if not _is_int(value):
        raise TypeError(f"{name}={value!r} must be an int, {hint}.")
    if value < 1:
        raise ValueError(f"{name}={value!r} must be >= 1, {hint}.")
    return int(value)


def _check_bool(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False.")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
