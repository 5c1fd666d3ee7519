"""Strategies -> Specs: split counts, PartitionSpecs, Layouts, pytree prefixes, parameter_plan,
and a table of malformed inputs whose errors must name the path, the value and a fix."""

import re
from collections import namedtuple

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxpar.mesh import make_mesh
from jaxpar.spec import MeshInfo, Spec
from jaxpar.strategy import (
    Layout,
    parse_in_strategy,
    parse_out_strategy,
    parse_parameter_plan,
)

M8 = make_mesh(8)
M42 = make_mesh((4, 2), ("dp", "tp"))
M224 = AbstractMesh((2, 2, 4), ("a", "b", "c"))  # 16 devices: only planned, never run
D8 = MeshInfo.of(M8).describe()
D42 = MeshInfo.of(M42).describe()
X = jax.ShapeDtypeStruct((32, 128), np.float32)
W = jax.ShapeDtypeStruct((128, 10), np.float32)
B = jax.ShapeDtypeStruct((10,), np.float32)
ARGS = (X, W, B)
PATHS = ["params/blocks/0/w", "params/blocks/1/w", "params/blocks/0/b", "x"]
SHAPES = [(128, 64), (64, 128), (64,), (32, 128)]
LAYOUT = Layout((2, 4), ("dp", "mp"))
Pair = namedtuple("Pair", "a b")


def S(*dims):
    """Spec shorthand: S("d0", ("d1", "d2"), None)."""
    return Spec(tuple(() if d is None else (d,) if isinstance(d, str) else d for d in dims))


def rx(*parts: str) -> str:
    """A regex matching the literal `parts` in order."""
    return ".*".join(re.escape(p) for p in parts)


# --- split counts ----------------------------------------------------------------------------


def test_reference_example():
    specs = parse_in_strategy(((4, 2), None, None), ARGS, M8)
    assert specs == [S(("d0", "d1"), "d2"), None, None]


@pytest.mark.parametrize("counts, expected", [
    ((4, 2), S(("d0", "d1"), "d2")),
    ((2, 4), S("d0", ("d1", "d2"))),
    ((8, 1), S(("d0", "d1", "d2"), None)),
    ((1, 2), S(None, "d0")),
    ((1, 1), S(None, None)),
    ((np.int64(2), 2), S("d0", "d1")),
    ([2, 2], S("d0", "d1")),
])
def test_counts_on_prime_mesh(counts, expected):
    assert parse_in_strategy((counts, None, None), ARGS, M8)[0] == expected


@pytest.mark.parametrize("counts, expected", [
    ((4, 2), S("dp", "tp")),
    ((2, 4), S("tp", "dp")),
    ((8, 1), S(("dp", "tp"), None)),
    ((1, 4), S(None, "dp")),
    ((2, 1), S("tp", None)),
])
def test_counts_on_named_mesh(counts, expected):
    assert parse_in_strategy((counts, None, None), ARGS, M42)[0] == expected


def test_counts_unique_by_size_on_mixed_mesh():
    # 4 then 2 on a2 x b2 x c4: only c can take the 4 once a 2 is left for dim 1.
    assert parse_in_strategy(((2, 4), None, None), ARGS, M224)[0] == S("a", "c")
    assert parse_in_strategy(((4, 2), None, None), ARGS, M224)[0] == S("c", "a")
    assert parse_in_strategy(((16, 1), None, None), ARGS, M224)[0] == S(("a", "b", "c"), None)


def test_none_everywhere():
    assert parse_in_strategy(None, ARGS, M8) == [None, None, None]
    assert parse_out_strategy(None, (X, B), M8) == [None, None]
    assert parse_parameter_plan(None, PATHS, SHAPES, M8) == {}


# --- PartitionSpec and Layout ----------------------------------------------------------------


def test_partition_specs():
    specs = parse_in_strategy((P(("d0", "d1"), "d2"), P(), P("d0")), ARGS, M8)
    assert specs == [S(("d0", "d1"), "d2"), S(None, None), S("d0")]
    assert parse_in_strategy((P(None, "tp"), None, None), ARGS, M42)[0] == S(None, "tp")


def test_layout_positional_when_device_matrix_is_the_mesh():
    layout = Layout((4, 2), ("x", "y"))
    specs = parse_in_strategy((layout("x", "y"), layout("None", "y"), layout(None)), ARGS, M42)
    assert specs == [S("dp", "tp"), S(None, "tp"), S(None)]


def test_layout_on_prime_mesh_maps_aliases_in_order():
    specs = parse_in_strategy((LAYOUT("dp", "mp"), LAYOUT(("dp", "mp"), "None"), None), ARGS, M8)
    assert specs == [S("d0", ("d1", "d2")), S(("d0", "d1", "d2"), None), None]
    assert parse_in_strategy((LAYOUT("mp", "dp"), None, None), ARGS, M42)[0] == S("dp", "tp")


def test_layout_repr_and_equality():
    assert repr(LAYOUT(("dp", "mp"), None)) == "Layout((2, 4), ('dp', 'mp'))(('dp', 'mp'), 'None')"
    assert LAYOUT("dp", None) == LAYOUT("dp", "None")


@pytest.mark.parametrize("make, exc, pattern", [
    (lambda: Layout((2, 0), ("a", "b")), ValueError, "positive ints"),
    (lambda: Layout((2, 4), "ab"), TypeError, "tuple of strings"),
    (lambda: Layout((2, 4), ("a",)), ValueError, "one distinct alias"),
    (lambda: Layout((2, 4), ("a", "None")), ValueError, "none of them 'None'"),
    (lambda: LAYOUT(3, "dp"), TypeError, rx("(3)", "each entry is an alias")),
    # a tensor_map given directly was taken as it came: repr failed on it, and planning with
    # it raised "object of type 'int' has no len()"
    (lambda: Layout((2, 4), ("dp", "mp"), tensor_map=5), TypeError,
     "tensor_map=5 must be a tuple"),
    (lambda: Layout((2, 4), ("dp", "mp"), tensor_map=("dp", 3)), TypeError,
     rx("(3)", "each entry is an alias")),
])
def test_layout_construction_errors(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


def test_a_layout_given_its_tensor_map_directly_is_the_one_called_so():
    direct = Layout((2, 4), ("dp", "mp"), tensor_map=["dp", None])
    assert direct == LAYOUT("dp", None) and repr(direct) == repr(LAYOUT("dp", "None"))


@pytest.mark.parametrize("make, exc, pattern", [
    # a string is no tuple of axis names: ("d0", ()) was the spec [d+0, -]
    (lambda: Spec(("d0", ())), TypeError, "dims must be a tuple with a tuple of mesh axis"),
    (lambda: Spec(5), TypeError, "Spec\\(dims=5"),
    (lambda: Spec([["d0"], []]), TypeError, "dims must be a tuple"),
    (lambda: Spec((("d0",),), "d1"), TypeError, "partial a tuple of axis names"),
    (lambda: Spec((("d0",), ("d0",))), ValueError, "a mesh axis cuts at most one dimension"),
    (lambda: Spec((("d0",),), ("d0",)), ValueError, "is not also partial"),
    (lambda: Spec.from_pspec(P("d0", "d1", "d2"), 2), ValueError, "3 entries, more than rank 2"),
])
def test_a_malformed_spec_is_refused(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()
    assert Spec((("d0",), ())) is Spec.from_pspec(P("d0"), 2)  # well formed: one object


# --- pytree prefixes -------------------------------------------------------------------------


def test_dict_prefix_and_leaf_strategies():
    params = {"w": W, "b": B, "blocks": [X, X]}
    strategy = ({"w": (1, 2), "b": None, "blocks": P("d0")},)
    # leaves in jax order: b, blocks/0, blocks/1, w
    assert parse_in_strategy(strategy, (params,), M8) == [None, S("d0", None), S("d0", None),
                                                         S(None, "d0")]


def test_prefix_levels():
    params = {"w": W, "blocks": [X, X]}
    assert parse_in_strategy((None,), (params,), M8) == [None] * 3
    assert parse_in_strategy(({"w": None, "blocks": [(2, 1), None]},), (params,), M8) == [
        S("d0", None), None, None]
    layout_all = parse_in_strategy((LAYOUT("dp", "None"),), ({"a": X, "b": W},), M8)
    assert layout_all == [S("d0", None)] * 2


def test_tuple_is_a_strategy_for_an_array_and_a_prefix_for_a_tuple():
    assert parse_in_strategy(((2, 4),), (X,), M8) == [S("d0", ("d1", "d2"))]
    assert parse_in_strategy((((2, 4), None),), ((X, W),), M8) == [S("d0", ("d1", "d2")), None]
    assert parse_in_strategy((((2, 1), (1, 2)),), ([X, W],), M8) == [S("d0", None),
                                                                     S(None, "d0")]


def test_namedtuple_and_none_children():
    assert parse_in_strategy((Pair((2, 1), None),), (Pair(X, W),), M8) == [S("d0", None), None]
    assert parse_in_strategy(({"a": (2, 1), "z": None},), ({"a": X, "z": None},), M8) == [
        S("d0", None)]


def test_out_strategy():
    assert parse_out_strategy(((8, 1),), jax.ShapeDtypeStruct((32, 10), np.float32), M8) == [
        S(("d0", "d1", "d2"), None)]
    assert parse_out_strategy((None, P("tp")), (X, B), M42) == [None, S("tp")]
    assert parse_out_strategy(({"y": (2, 1)},), {"y": X}, M8) == [S("d0", None)]
    # a returned list (lax.top_k's values and indices) takes one entry per element too, as
    # a tuple does; one entry for the whole list still works
    assert parse_out_strategy(((8, 1), None), [X, X], M8) == [S(("d0", "d1", "d2"), None), None]
    assert parse_out_strategy(([(8, 1), None],), [X, X], M8) == [
        S(("d0", "d1", "d2"), None), None]


# --- parameter_plan --------------------------------------------------------------------------


def test_parameter_plan_exact_suffix_and_glob():
    plan = {"params/blocks/0/w": (2, 1), "blocks/1/w": P(None, "d1"), "*/b": (8,), "x": None}
    assert parse_parameter_plan(plan, PATHS, SHAPES, M8) == {
        0: S("d0", None), 1: S(None, "d1"), 2: S(("d0", "d1", "d2"))}


def test_parameter_plan_glob_sets_every_match_and_exact_wins():
    assert parse_parameter_plan({"blocks/*/w": (1, 4)}, PATHS, SHAPES, M8) == {
        0: S(None, ("d0", "d1")), 1: S(None, ("d0", "d1"))}
    paths = ["w", "params/w"]
    assert parse_parameter_plan({"w": (2,)}, paths, [(4,), (4,)], M8) == {0: S("d0")}


def test_parameter_plan_agreeing_keys_are_fine():
    plan = {"*/w": (2, 1), "blocks/0/w": (2, 1)}
    assert parse_parameter_plan(plan, PATHS, SHAPES, M8) == {0: S("d0", None), 1: S("d0", None)}


# --- malformed inputs ------------------------------------------------------------------------


def _in(strategy, args=ARGS, mesh=M8):
    return lambda: parse_in_strategy(strategy, args, mesh)


def _plan(plan, mesh=M8):
    return lambda: parse_parameter_plan(plan, PATHS, SHAPES, mesh)


TREE = {"w": W, "b": B}

MALFORMED = [
    pytest.param(_in([(4, 2), None, None]), TypeError,
                 rx("in_strategy=[(4, 2), None, None]", "must be None or a tuple",
                    "e.g. ((8, 1), (8, 1), (2,))"), id="in_strategy-list"),
    pytest.param(_in("dp"), TypeError, rx("in_strategy='dp'", "one entry per positional"),
                 id="in_strategy-str"),
    pytest.param(_in(((4, 2),)), ValueError,
                 rx("in_strategy=((4, 2),) has 1 entry", "3 positional argument",
                    "(32, 128)", D8, "None to let jaxpar decide"), id="too-few-entries"),
    pytest.param(_in((4, 2), (X,)), ValueError,
                 rx("in_strategy=(4, 2) has 2 entries", "write ((4, 2),)"), id="unwrapped-tuple"),
    pytest.param(_in(((4,), None, None)), ValueError,
                 rx("in_strategy[0]=(4,)", "(32, 128)", D8, "rank 2 needs 2 counts",
                    "e.g. (8, 1)"), id="wrong-rank"),
    pytest.param(_in(((4, 2.0), None, None)), TypeError,
                 rx("in_strategy[0]=(4, 2.0)", "(32, 128)", D8, "2.0", "float",
                    "positive int"), id="float-count"),
    pytest.param(_in(((4, "2"), None, None)), TypeError,
                 rx("in_strategy[0]=(4, '2')", "'2'", "is a str", "positive int"),
                 id="str-count"),
    pytest.param(_in(((True, 1), None, None)), TypeError,
                 rx("in_strategy[0]=(True, 1)", "True", "bool", "positive int"), id="bool-count"),
    pytest.param(_in(((0, 1), None, None)), ValueError,
                 rx("in_strategy[0]=(0, 1)", "count 0", "not positive", "use 1"),
                 id="zero-count"),
    pytest.param(_in((None, (-2, 1), None)), ValueError,
                 rx("in_strategy[1]=(-2, 1)", "(128, 10)", "count -2", "use 1"),
                 id="negative-count"),
    pytest.param(_in((None, (1, 4), None)), ValueError,
                 rx("in_strategy[1]=(1, 4)", "(128, 10)", D8, "does not divide dim 1 of size 10",
                    "1, 2, 5", "1 or 2"), id="count-not-dividing"),
    pytest.param(_in(((4, 4), None, None)), ValueError,
                 rx("in_strategy[0]=(4, 4)", D8, "16 pieces", "8 devices", "at most 8"),
                 id="product-too-large"),
    pytest.param(_in(((3, 1), None, None), (jax.ShapeDtypeStruct((12, 4), np.float32), W, B)),
                 ValueError, rx("in_strategy[0]=(3, 1)", "(12, 4)", D8, "count 3",
                                "1, 2, 4 or 8", "PartitionSpec"), id="count-not-expressible"),
    pytest.param(_in(((2, 2), None, None), mesh=M42), ValueError,
                 rx("in_strategy[0]=(2, 2)", D42, "no set of distinct mesh axes",
                    "explicit PartitionSpec"), id="counts-do-not-fit-together"),
    pytest.param(_in(((4, 1), None, None), mesh=M224), ValueError,
                 rx("in_strategy[0]=(4, 1)", "more than one way", "P(('a', 'b'),) or P('c',)"),
                 id="ambiguous-counts"),
    pytest.param(_in((P("x"), None, None)), ValueError,
                 rx("in_strategy[0]=P('x',)", "(32, 128)", D8, "axis 'x' is not in the mesh",
                    "d0, d1, d2"), id="pspec-unknown-axis"),
    pytest.param(_in((P("dq"), None, None), mesh=M42), ValueError,
                 rx("in_strategy[0]=P('dq',)", "did you mean 'dp'?"), id="pspec-typo"),
    pytest.param(_in((P("d0", "d0"), None, None)), ValueError,
                 rx("in_strategy[0]=P('d0', 'd0')", "cuts dims 0 and 1", "one dimension only"),
                 id="pspec-axis-twice"),
    pytest.param(_in((P(("d0", "d0")), None, None)), ValueError,
                 rx("in_strategy[0]=P(('d0', 'd0'),)", "'d0' is listed twice in dim 0"),
                 id="pspec-axis-twice-in-one-dim"),
    pytest.param(_in((("d0", None), None, None)), TypeError,
                 rx("in_strategy[0]=('d0', None)", "is a str, not an int",
                    "write a PartitionSpec: P('d0', None)"), id="axis-names-as-a-tuple"),
    # an empty tuple names no axis: P((),) was proposed, itself wrong for a 0-d array
    pytest.param(_in((((),),), (jax.ShapeDtypeStruct((), np.float32),)), TypeError,
                 rx("in_strategy[0]=((),)", "is a tuple, not an int",
                    "each count is a positive int, e.g. ()"), id="empty-tuple-for-a-scalar"),
    pytest.param(_in((None, None, P("d0", "d1"))), ValueError,
                 rx("in_strategy[2]=P('d0', 'd1')", "(10,)", "2 entries", "rank 1",
                    "at most 1"), id="pspec-too-long"),
    pytest.param(_in((None, P(None, ("d0", "d1")), None)), ValueError,
                 rx("in_strategy[1]=P(None, ('d0', 'd1'))", "(128, 10)", "4 pieces",
                    "1 or 2"), id="pspec-not-dividing"),
    pytest.param(_in((P(("d1", "d0")), None, None)), ValueError,
                 rx("in_strategy[0]=P(('d1', 'd0'),)", "out of mesh order",
                    "write ('d0', 'd1')"), id="pspec-out-of-order"),
    pytest.param(_in((P(3), None, None)), TypeError,
                 rx("in_strategy[0]=P(3,)", "not an axis name", "('d0', 'd1', 'd2')"),
                 id="pspec-int-entry"),
    pytest.param(_in((P(P.UNCONSTRAINED), None, None)), ValueError,
                 rx("in_strategy[0]=P(UNCONSTRAINED,)", "use None"), id="pspec-unconstrained"),
    pytest.param(_in(({"w": (1, 2)},), (TREE,)), ValueError,
                 rx("in_strategy[0]={'w': (1, 2)}", "keys ['b', 'w']", "(128, 10)",
                    "e.g. {'w': None, 'b': None}"), id="prefix-missing-key"),
    pytest.param(_in(([None],), ([X, W],)), ValueError,
                 rx("in_strategy[0]=[None]", "list of 2 items", "e.g. [None, None]"),
                 id="prefix-wrong-length"),
    pytest.param(_in(({"w": (1, 2)}, None, None)), TypeError,
                 rx("in_strategy[0]={'w': (1, 2)}", "(32, 128)", "dict", "not a strategy",
                    "e.g. (8, 1)"), id="prefix-dict-for-array"),
    pytest.param(_in(({"w": (3, 1), "b": None},), (TREE,)), ValueError,
                 rx("in_strategy[0]['w']=(3, 1)", "(128, 10)", "count 3"),
                 id="prefix-bad-leaf-path"),
    pytest.param(_in(((2, 1),), ((X, W),)), TypeError,
                 rx("in_strategy[0][0]=2", "(32, 128)", "int 2 is not a strategy",
                    "one entry per item", "e.g. (8, 1)"), id="ints-for-a-tuple-argument"),
    pytest.param(_in((LAYOUT("dp", "xx"), None, None)), ValueError,
                 rx("in_strategy[0]=Layout((2, 4), ('dp', 'mp'))('dp', 'xx')", D8,
                    "alias 'xx'", "use one of ('dp', 'mp')"), id="layout-unknown-alias"),
    pytest.param(_in((Layout((2, 2), ("a", "b"))("a", "b"), None, None)), ValueError,
                 rx("in_strategy[0]=Layout((2, 2)", "holds 4 devices", "mesh has 8",
                    "equal to the mesh shape (2, 2, 2)"), id="layout-device-matrix-size"),
    pytest.param(_in((Layout((2, 2, 2), ("a", "b", "c"))("a", "b"), None, None), mesh=M42),
                 ValueError, rx("in_strategy[0]=Layout((2, 2, 2)", D42, "does not map onto",
                                "(4, 2)"), id="layout-device-matrix-misfit"),
    pytest.param(_in((LAYOUT, None, None)), TypeError,
                 rx("in_strategy[0]=Layout((2, 4), ('dp', 'mp'))", "not applied",
                    "layout('dp', 'None')"), id="layout-not-called"),
    pytest.param(_in((None, None, LAYOUT("dp", "mp"))), ValueError,
                 rx("in_strategy[2]=Layout", "(10,)", "rank 1 needs 1 tensor_map entries",
                    "one alias"), id="layout-wrong-rank"),
    pytest.param(_in((LAYOUT("dp", "dp"), None, None)), ValueError,
                 rx("in_strategy[0]=Layout", "alias 'dp' is used 2 times", "'None'"),
                 id="layout-alias-twice"),
    pytest.param(_in((LAYOUT(("mp", "dp"), "None"), None, None)), ValueError,
                 rx("in_strategy[0]=Layout", "out of mesh order", "write ('dp', 'mp') for it"),
                 id="layout-out-of-order"),
    pytest.param(_plan([("w", (2, 1))]), TypeError,
                 rx("parameter_plan=[('w', (2, 1))]", "must be a dict", "{'params/w': (1, 8)}"),
                 id="plan-not-dict"),
    pytest.param(_plan({"blocks/0/wq": (2, 1)}), ValueError,
                 rx("parameter_plan['blocks/0/wq'] matches no parameter",
                    "closest known paths: 'blocks/0/w'"), id="plan-unknown-path"),
    pytest.param(_plan({"blocks/0/w": "dp"}), TypeError,
                 rx("parameter_plan['blocks/0/w']='dp'", "(128, 64)", D8, "not a strategy",
                    "PartitionSpec"), id="plan-bad-value"),
    pytest.param(_plan({"blocks/0/w": (3, 1)}), ValueError,
                 rx("parameter_plan['blocks/0/w']=(3, 1)", "(128, 64)", "does not divide",
                    "1, 2, 4 or 8"), id="plan-bad-count"),
    pytest.param(_plan({"*/w": (1, 16)}), ValueError,
                 rx("parameter_plan['*/w'] (leaf 'params/blocks/0/w')=(1, 16)",
                    "16 pieces", "at most 8"), id="plan-glob-bad-count"),
    pytest.param(_plan({"w": (2, 1)}), ValueError,
                 rx("parameter_plan['w'] matches 2 parameters", "'params/blocks/0/w'",
                    "glob such as '*/w'"), id="plan-ambiguous-key"),
    pytest.param(_plan({3: (2, 1)}), TypeError,
                 rx("parameter_plan key 3", "parameter path (str)"), id="plan-key-not-str"),
    pytest.param(_plan({"*/w": (2, 1), "blocks/1/w": (1, 2)}), ValueError,
                 rx("parameter_plan['blocks/1/w']=(1, 2)", "parameter_plan['*/w'] already set",
                    "one strategy"), id="plan-conflict"),
    pytest.param(lambda: parse_out_strategy(((2, 1), None), X, M8), ValueError,
                 rx("out_strategy=((2, 1), None) has 2 entries", "1 output", "(32, 128)",
                    "e.g. ((8, 1),)"), id="out-wrong-count"),
    pytest.param(lambda: parse_out_strategy([(2, 1)], X, M8), TypeError,
                 rx("out_strategy=[(2, 1)]", "must be None or a tuple"), id="out-not-tuple"),
    pytest.param(lambda: parse_out_strategy((None, (3,)), (X, B), M8), ValueError,
                 rx("out_strategy[1]=(3,)", "(10,)", "does not divide", "1 or 2"),
                 id="out-bad-count"),
    pytest.param(lambda: parse_out_strategy((4, 1), X, M8), ValueError,
                 rx("out_strategy=(4, 1) has 2 entries",
                    "(for a single array output write ((4, 1),))"), id="out-counts-unnested"),
]


@pytest.mark.parametrize("make, exc, pattern", MALFORMED)
def test_malformed_strategies_are_explained(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


def test_empty_pytree_nodes_take_an_empty_strategy():
    # optax's Adam state ends in EmptyState(), a node with no leaves; a strategy tree made
    # with tree.map over the state has it too, and must match it.
    import optax

    params = {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}
    state = jax.eval_shape(optax.adam(1e-3).init, params)
    strategy = jax.tree.map(lambda _: P(), state)
    specs = parse_in_strategy((strategy,), (state,), make_mesh(8))
    assert len(specs) == len(jax.tree.leaves(state))
    assert all(s == Spec.replicated(len(s.dims)) for s in specs)
