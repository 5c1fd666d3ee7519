"""The resharding model against XLA: predicted and compiled collective bytes for pairs of specs.

For every pair of distinct specs of an array of the given shape on a mesh of simulated CPU
devices (or a seeded sample of `--pairs` of them; specs that do not divide the shape are left
out), a program is compiled in the context a plan lowers to: a value made under one sharding
constraint (src), constrained to another (dst) before an op reads it. The collectives XLA emits
(`jaxpar.collective_stats`) are compared with `jaxpar.cost.reshard`'s, in bytes per device. A
pair agrees when the totals are within 10% (plus 0.1% of the array, for scalars' rounding).
Reported per mesh and shape: how many pairs agree, the summed absolute error over the summed
measured bytes, and the pairs that miss most; and of the pairs that agree, how many the model
also puts on the mesh axes XLA's collectives span (`jaxpar.analysis.collective_axes`: the links
they cross, which decide their time on a mesh across nodes), each kind's bytes per set of axes
within 10%. With --splat the array is a literal broadcast (jnp.zeros made under src's
constraint, read under dst's), and the model's price is a splat's (`jaxpar.cost.comm.of_splat`:
what comes before an all-to-all, or before a permute after a gather, moves nothing).

The process gets as many CPU devices as the largest mesh asks (8 at least); a mesh larger
than a JAX already started has is refused before anything compiles. Writes
DIR/reshard_accuracy.json and DIR/reshard_accuracy.md.

    python benchmarks/reshard_accuracy.py --out results
    python benchmarks/reshard_accuracy.py --cases 2x2x2:8,8 --pairs 100 --seed 1
    python benchmarks/reshard_accuracy.py --cases 4x4:64,64 2x2x2x2:16,32,64 --pairs 0
    python benchmarks/reshard_accuracy.py --splat --cases 2x2x2:64,64 2x2x2:16,32,64 \
        --pairs 200 --out results/splat
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

DEFAULT_CASES = ("4x2:64,64", "2x2x2:64,64", "4x2:16,32,64", "2x2x2:16,32,64")


def all_specs(rank: int, names: tuple[str, ...]) -> list[tuple[tuple[str, ...], ...]]:
    """Every spec of a rank-`rank` array: each mesh axis on one dim or none, in every order."""
    out = set()
    for where in itertools.product(range(-1, rank), repeat=len(names)):
        dims = [[a for a, d in zip(names, where, strict=True) if d == k] for k in range(rank)]
        for order in itertools.product(*(itertools.permutations(d) for d in dims)):
            out.add(tuple(order))
    return sorted(out)


def parse_case(case: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A case, MESH:SHAPE (4x2:16,32,64) -> (mesh axis sizes, array shape); a ValueError
    naming the case and the form otherwise."""
    mesh_part, _, shape_part = case.partition(":")
    try:
        sizes = tuple(int(n) for n in mesh_part.split("x"))
        shape = tuple(int(n) for n in shape_part.split(","))
    except ValueError:
        sizes = shape = ()
    if not sizes or not shape or min(sizes + shape) < 1:
        raise ValueError(f"--cases {case!r}: give MESH:SHAPE, the mesh's axis sizes joined by "
                         "'x' and the array's dimensions by ',', all positive (4x2:16,32,64).")
    return sizes, shape


def _check_devices(case: str, cpus: list) -> list:
    """The CPU devices of the case's mesh; a ValueError where JAX has too few."""
    n = math.prod(parse_case(case)[0])
    if len(cpus) < n:
        raise ValueError(f"--cases {case!r}: the mesh needs {n} CPU devices and JAX has "
                         f"{len(cpus)} (started before the benchmark asked for more, or "
                         "XLA_FLAGS sets the count): run it in a fresh process, or set "
                         f"--xla_force_host_platform_device_count={n} in XLA_FLAGS.")
    return cpus[:n]


def measure(case: str, pairs: int | None, seed: int = 0, splat: bool = False) -> dict:
    """Compile every (or a sample of `pairs`) spec pair of one "MESH:SHAPE" case, of the specs
    that divide the shape. splat: the array resharded is a literal broadcast (jnp.zeros),
    priced as one (comm.of_splat)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from jaxpar.analysis import collective_axes, collective_ops, collective_stats
    from jaxpar.cost.comm import of_splat, reshard
    from jaxpar.spec import MeshInfo, Spec

    sizes, shape = parse_case(case)
    names = tuple(f"d{i}" for i in range(len(sizes)))
    devices = _check_devices(case, jax.devices("cpu"))
    mesh = Mesh(np.array(devices).reshape(sizes), names)
    info = MeshInfo.of(mesh)
    every = [Spec(dims) for dims in all_specs(len(shape), names)]
    specs = [s for s in every if s.fits(shape, info)]
    todo = [(a, b) for a in specs for b in specs if a != b]
    if pairs is not None and pairs < len(todo):
        todo = random.Random(seed).sample(todo, pairs)
    nbytes = float(np.prod(shape)) * 4
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    rows = []
    for src, dst in todo:
        a, b = NamedSharding(mesh, src.to_pspec()), NamedSharding(mesh, dst.to_pspec())

        def f(v, a=a, b=b):
            made = jax.lax.with_sharding_constraint(jnp.sin(v), a)
            return jnp.cos(jax.lax.with_sharding_constraint(made, b))

        def zeros(v, a=a, b=b):  # the zeros made in src's layout, read in dst's
            made = jax.lax.with_sharding_constraint(jnp.zeros(shape, jnp.float32), a)
            return jnp.cos(jax.lax.with_sharding_constraint(made, b) + v)
        compiled = (jax.jit(zeros, in_shardings=b, out_shardings=b) if splat else
                    jax.jit(f, in_shardings=a, out_shardings=b)).lower(x).compile()
        measured = {k: v["bytes"] for k, v in collective_stats(compiled).items()}
        predicted: dict[str, float] = {}
        links: dict[str, dict[str, float]] = {"predicted": {}, "measured": {}}
        moves = reshard(src, dst, nbytes, info)
        # a splat where src's pieces hold two elements or more: XLA gathers a piece of one
        # element as any array's (OpGraph.splats asks that of every layout)
        as_splat = splat and math.prod(shape) >= 2 * src.shards(info)
        for c in of_splat(moves) if as_splat else moves:
            predicted[c.kind] = predicted.get(c.kind, 0.0) + c.bytes
            _add(links["predicted"], c.kind, info.order(c.axes), c.bytes)
        for op in collective_ops(compiled):
            _add(links["measured"], op.kind, collective_axes(op, info), op.bytes * op.count)
        rows.append({"src": str(src), "dst": str(dst), "predicted": predicted,
                     "measured": measured, "links": links})
    return {"case": case, "nbytes": nbytes, "specs": len(specs),
            "unfit": len(every) - len(specs), "seed": seed, "splat": splat, "rows": rows}


def _add(into: dict[str, float], kind: str, axes: tuple[str, ...], nbytes: float) -> None:
    """Bytes by "kind over axes" (a JSON key)."""
    key = f"{kind} over {'+'.join(axes)}"
    into[key] = into.get(key, 0.0) + nbytes


def _close(p: float, m: float, nbytes: float) -> bool:
    """Predicted and measured bytes within 10%, plus 0.1% of the array."""
    return abs(p - m) <= 0.1 * max(p, m) + 1e-3 * nbytes


def agrees(row: dict, nbytes: float) -> bool:
    return _close(sum(row["predicted"].values()), sum(row["measured"].values()), nbytes)


def same_links(row: dict, nbytes: float) -> bool:
    """Whether every kind's bytes over every set of mesh axes agree (as agrees() does)."""
    p, m = row["links"]["predicted"], row["links"]["measured"]
    return all(_close(p.get(k, 0.0), m.get(k, 0.0), nbytes) for k in set(p) | set(m))


def summary(result: dict) -> dict:
    rows, n = result["rows"], result["nbytes"]
    error = sum(abs(sum(r["predicted"].values()) - sum(r["measured"].values())) for r in rows)
    measured = sum(sum(r["measured"].values()) for r in rows)
    return {"pairs": len(rows), "agree": sum(agrees(r, n) for r in rows),
            "links": sum(agrees(r, n) and same_links(r, n) for r in rows),
            "error": error / measured if measured else 0.0}


def markdown(results: list[dict], jax_version: str) -> str:
    lines = [f"Resharding model against XLA (jax {jax_version}), each pair compiled as a plan "
             "lowers it (a value under one sharding constraint, constrained to another)." +
             (" The array is a literal broadcast (jnp.zeros), priced as a splat."
              if any(r.get("splat") for r in results) else ""), "",
             "| mesh:shape | specs | pairs | agree (within 10%) | and on the same axes | "
             "abs error / measured |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        s = r["summary"]
        lines.append(f"| {r['case']} | {r['specs']} | {s['pairs']} | {s['agree']} "
                     f"({s['agree'] / max(s['pairs'], 1):.0%}) | {s['links']} "
                     f"({s['links'] / max(s['pairs'], 1):.0%}) | {s['error']:.3f} |")
    for r in results:
        if r.get("unfit"):
            lines += ["", f"{r['case']}: {r['unfit']} specs left out, which do not divide the "
                          "shape"]
    for r in results:
        n = r["nbytes"]
        worst = sorted((row for row in r["rows"] if not agrees(row, n)),
                       key=lambda row: -abs(sum(row["predicted"].values())
                                            - sum(row["measured"].values())))[:5]
        if worst:
            lines += ["", f"{r['case']}: the pairs that miss most (bytes as a fraction of the "
                          "array)", ""]
            for row in worst:
                p = {k: round(v / n, 3) for k, v in row["predicted"].items()}
                m = {k: round(v / n, 3) for k, v in row["measured"].items()}
                lines.append(f"- {row['src']} -> {row['dst']}: predicted {p}, measured {m}")
    for r in results:
        n = r["nbytes"]
        apart = [row for row in r["rows"] if agrees(row, n) and not same_links(row, n)][:5]
        if apart:
            lines += ["", f"{r['case']}: pairs whose bytes agree on other mesh axes (bytes as a "
                          "fraction of the array)", ""]
            for row in apart:
                p, m = ({k: round(v / n, 3) for k, v in row["links"][w].items()}
                        for w in ("predicted", "measured"))
                lines.append(f"- {row['src']} -> {row['dst']}: predicted {p}, measured {m}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                   help="MESH:SHAPE, e.g. 4x2:64,64 or 4x4:64,64 (the mesh's axis sizes, "
                        "simulated CPU devices; the array's shape)")
    p.add_argument("--pairs", type=int, default=300,
                   help="spec pairs per case, a seeded sample (0: every pair)")
    p.add_argument("--seed", type=int, default=0,
                   help="the sample's seed (another seed: pairs the model was not fitted on)")
    p.add_argument("--splat", action="store_true",
                   help="reshard a literal broadcast (jnp.zeros), priced as one (comm.of_splat)")
    p.add_argument("--out", type=Path, default=Path("results"))
    a = p.parse_args(argv)
    devices = max([8] + [math.prod(parse_case(c)[0]) for c in a.cases])
    from jaxpar.demo import ensure_devices

    ensure_devices(devices)
    import jax

    for case in a.cases:  # before anything compiles
        _check_devices(case, jax.devices("cpu"))

    results = []
    for case in a.cases:
        start = time.perf_counter()
        r = measure(case, a.pairs or None, a.seed, a.splat)
        r["summary"], r["seconds"] = summary(r), time.perf_counter() - start
        results.append(r)
        s = r["summary"]
        print(f"{case}: {s['agree']} of {s['pairs']} pairs agree ({s['links']} on the same "
              f"mesh axes), abs error / measured {s['error']:.3f} ({r['seconds']:.0f} s)",
              flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "reshard_accuracy.json").write_text(
        json.dumps({"jax": jax.__version__, "results": results}, indent=1))
    text = markdown(results, jax.__version__)
    (a.out / "reshard_accuracy.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
