"""Linear queries for PMWG: every kind against a dense reference, validation, cache."""

import math
import pickle
from fractions import Fraction

import numpy as np
import pytest

from dpstream.core.pmwg.queries import MAX_BOXES, WEIGHT_BITS, WEIGHT_UNIT, LinearQuery
from dpstream.core.pmwg.query_compiler import QueryCompiler
from dpstream.core.pmwg.query_parser import (
    MAX_MARGINAL_CELLS,
    QUERY_SCHEMA,
    QueryError,
    parse_query,
)
from dpstream.core.pmwg.universe import Universe
from dpstream.errors import InvalidParameterError

S = QUERY_SCHEMA
SPEC = [
    {"name": "country", "values": ["de", "fr", "it", "es", "nl"]},
    {"name": "device", "values": ["ios", "android", "web"]},
    {"name": "age", "edges": [0, 18, 30, 65, 120]},
    {"name": "plan", "values": ["free", "pro"]},
]


@pytest.fixture(scope="module")
def universe():
    return Universe.from_spec(SPEC)


@pytest.fixture(scope="module")
def data(universe):
    rng = np.random.default_rng(11)
    hist = rng.random(universe.size)
    hist /= hist.sum()
    counts = rng.integers(0, 1000, universe.size)
    return hist, counts


def count(*where):
    return {"schema": S, "kind": "count", "where": list(where)}


def codes_grid(universe):
    """codes[j, i] = the code of attribute j in cell i (an independent reference)."""
    return np.indices(universe.shape).reshape(len(universe.shape), -1)


def predicate_weights(universe, selection):
    """Dense 0/1 reference weights: selection maps attribute position -> allowed codes."""
    grid = codes_grid(universe)
    mask = np.ones(universe.size, dtype=bool)
    for pos, allowed in selection.items():
        mask &= np.isin(grid[pos], list(allowed))
    return mask.astype(float)


def exact_units(query):
    units = np.rint(query.dense_weights() * WEIGHT_UNIT).astype(np.int64)
    np.testing.assert_array_equal(units / WEIGHT_UNIT, query.dense_weights())
    return units


def check_against_dense(query, hist, counts, log_factor=0.37):
    """weighted_sum / weighted_count / multiply / support_size agree with the dense form."""
    w = query.dense_weights()
    assert w.shape == hist.shape and w.dtype == np.float64
    assert query.support_size == int(np.count_nonzero(w))
    assert query.n_cells == hist.shape[0]
    assert query.weighted_sum(hist) == pytest.approx(float(w @ hist), rel=1e-12, abs=1e-15)
    units = exact_units(query)
    assert query.weighted_count(counts) == sum(
        int(u) * int(c) for u, c in zip(units, counts, strict=True)
    )
    values = hist.copy()
    delta = query.multiply(values, log_factor)
    expected = hist * np.exp(log_factor * w)
    np.testing.assert_allclose(values, expected, rtol=1e-14, atol=0)
    outside = w == 0
    np.testing.assert_array_equal(values[outside], hist[outside])  # untouched, bit for bit
    assert delta == pytest.approx(float(expected.sum() - hist.sum()), rel=1e-9, abs=1e-15)


# -- every kind against a dense reference ------------------------------------------------------


def test_constants():
    assert WEIGHT_BITS == 16 and WEIGHT_UNIT == 2**16
    assert MAX_MARGINAL_CELLS == 4096 and MAX_BOXES == 8
    assert S == "dpstream.query/1"
    assert issubclass(QueryError, InvalidParameterError)


def test_count_with_every_condition(universe, data):
    hist, counts = data
    (query,) = parse_query(
        count(
            {"attr": "country", "eq": "fr"},
            {"attr": "device", "in": ["web", "ios"]},
            {"attr": "age", "range": [18, 65]},
        ),
        universe,
    )
    assert isinstance(query, LinearQuery)
    reference = predicate_weights(universe, {0: [1], 1: [0, 2], 2: [1, 2]})
    np.testing.assert_array_equal(query.dense_weights(), reference)
    assert query.support_size == 1 * 2 * 2 * 2
    assert query.key == "count:country=1;device=0,2;age=1-2"
    check_against_dense(query, hist, counts)


def test_count_without_conditions_is_everything(universe, data):
    hist, counts = data
    for obj in (
        {"schema": S, "kind": "count"},
        count(),
        count({"attr": "plan", "in": ["pro", "free"]}),  # every value: no restriction
        count({"attr": "age", "range": [0, 120]}),
    ):
        (query,) = parse_query(obj, universe)
        assert query.key == "count:all"
        assert query.support_size == universe.size
        assert query.weighted_sum(hist) == pytest.approx(1.0)
        assert query.weighted_count(counts) == int(counts.sum()) * WEIGHT_UNIT
        check_against_dense(query, hist, counts)


@pytest.mark.parametrize(
    ("where", "selection"),
    [
        ([{"attr": "country", "eq": "de"}], {0: [0]}),
        ([{"attr": "plan", "eq": "pro"}], {3: [1]}),
        ([{"attr": "device", "eq": "android"}], {1: [1]}),
        ([{"attr": "country", "in": ["de", "it", "nl"]}], {0: [0, 2, 4]}),
        ([{"attr": "age", "range": [0, 18]}], {2: [0]}),
        ([{"attr": "age", "range": [65, 120]}], {2: [3]}),
        ([{"attr": "country", "eq": "es"}, {"attr": "plan", "eq": "free"}], {0: [3], 3: [0]}),
        (
            [{"attr": "country", "eq": "es"}, {"attr": "device", "eq": "web"}],
            {0: [3], 1: [2]},
        ),
        (
            [
                {"attr": "country", "eq": "it"},
                {"attr": "device", "eq": "ios"},
                {"attr": "age", "range": [30, 65]},
                {"attr": "plan", "eq": "pro"},
            ],
            {0: [2], 1: [0], 2: [2], 3: [1]},
        ),  # a single cell
        (
            [{"attr": "country", "in": ["de", "it", "nl"]}, {"attr": "age", "range": [18, 120]}],
            {0: [0, 2, 4], 2: [1, 2, 3]},
        ),
        (
            [
                {"attr": "country", "in": ["de", "it", "nl"]},
                {"attr": "device", "in": ["ios", "web"]},
                {"attr": "age", "range": [18, 120]},
                {"attr": "plan", "eq": "pro"},
            ],
            {0: [0, 2, 4], 1: [0, 2], 2: [1, 2, 3], 3: [1]},
        ),
        (
            [
                {"attr": "country", "in": ["de", "it", "nl"]},
                {"attr": "device", "in": ["ios", "web"]},
            ],
            {0: [0, 2, 4], 1: [0, 2]},
        ),
    ],
)
def test_predicates_against_brute_force(universe, data, where, selection):
    hist, counts = data
    (query,) = parse_query(count(*where), universe)
    np.testing.assert_array_equal(query.dense_weights(), predicate_weights(universe, selection))
    check_against_dense(query, hist, counts)
    check_against_dense(query, hist, counts, log_factor=-2.5)


def test_random_predicates_against_brute_force():
    """Random selections on a 5-attribute universe exercise views, folding and gathers."""
    spec = [
        {"name": f"a{i}", "values": [f"v{j}" for j in range(n)]}
        for i, n in enumerate((4, 1, 6, 5, 3))
    ]
    universe = Universe.from_spec(spec)
    rng = np.random.default_rng(5)
    hist = rng.random(universe.size)
    counts = rng.integers(0, 50, universe.size)
    plans = set()
    for _ in range(300):
        where, selection = [], {}
        for pos, size in enumerate(universe.shape):
            if rng.random() < 0.7:
                chosen = sorted(rng.choice(size, rng.integers(1, size + 1), replace=False).tolist())
                where.append({"attr": f"a{pos}", "in": [f"v{c}" for c in chosen]})
                selection[pos] = chosen
        order = rng.permutation(len(where))
        (query,) = parse_query(count(*[where[i] for i in order]), universe)
        np.testing.assert_array_equal(query.dense_weights(), predicate_weights(universe, selection))
        check_against_dense(query, hist, counts, log_factor=float(rng.normal()))
        for box in query._boxes:  # white box: which compiled forms were exercised
            gather = any(isinstance(i, np.ndarray) for i in box.index)
            plans.add("gather" if gather else "view" if box.is_view else "cell")
    assert plans == {"gather", "view", "cell"}


def test_marginal_order_count_and_subqueries(universe, data):
    hist, counts = data
    queries = parse_query(
        {"schema": S, "kind": "marginal", "attrs": ["device", "country"]}, universe
    )
    assert len(queries) == 3 * 5
    devices, countries = SPEC[1]["values"], SPEC[0]["values"]
    # C order over the listed attributes: the first listed is most significant
    for k, query in enumerate(queries):
        d, c = divmod(k, 5)
        (same,) = parse_query(
            count({"attr": "country", "eq": countries[c]}, {"attr": "device", "eq": devices[d]}),
            universe,
        )
        assert query.key == same.key
        np.testing.assert_array_equal(query.dense_weights(), same.dense_weights())
        check_against_dense(query, hist, counts)
    # the marginal partitions the universe
    assert sum(q.weighted_count(counts) for q in queries) == int(counts.sum()) * WEIGHT_UNIT
    np.testing.assert_array_equal(sum(q.dense_weights() for q in queries), 1.0)


def test_marginal_with_where(universe, data):
    hist, counts = data
    where = [{"attr": "plan", "eq": "pro"}, {"attr": "age", "range": [18, 65]}]
    queries = parse_query(
        {"schema": S, "kind": "marginal", "attrs": ["age", "country"], "where": where}, universe
    )
    assert len(queries) == 4 * 5
    (restricted,) = parse_query(count(*where), universe)
    total = sum(q.dense_weights() for q in queries)
    np.testing.assert_array_equal(total, restricted.dense_weights())
    # age buckets 0 and 3 are excluded by where: their sub-queries are empty
    for k, query in enumerate(queries):
        bucket = k // 5
        if bucket in (0, 3):
            assert query.support_size == 0 and query.key == "count:empty"
            assert query.weighted_sum(hist) == 0.0 and query.weighted_count(counts) == 0
            values = hist.copy()
            assert query.multiply(values, 1.0) == 0.0
            np.testing.assert_array_equal(values, hist)
        else:
            assert query.support_size == 3 * 1
        check_against_dense(query, hist, counts)


def test_marginal_cap():
    spec = [{"name": f"a{i}", "values": [str(j) for j in range(17)]} for i in range(3)]
    universe = Universe.from_spec(spec)
    assert (
        len(parse_query({"schema": S, "kind": "marginal", "attrs": ["a0", "a1"]}, universe)) == 289
    )
    with pytest.raises(QueryError) as info:
        parse_query({"schema": S, "kind": "marginal", "attrs": ["a0", "a1", "a2"]}, universe)
    assert str(info.value) == (
        "query.attrs: the marginal over a0 (17) x a1 (17) x a2 (17) has 4913 cells; "
        "at most 4096 sub-queries are allowed"
    )


def test_range_selects_buckets_between_edges(universe):
    grid = codes_grid(universe)
    edges = [0, 18, 30, 65, 120]
    for i in range(len(edges)):
        for j in range(i + 1, len(edges)):
            (query,) = parse_query(count({"attr": "age", "range": [edges[i], edges[j]]}), universe)
            expected = ((grid[2] >= i) & (grid[2] < j)).astype(float)
            np.testing.assert_array_equal(query.dense_weights(), expected)
    (query,) = parse_query(count({"attr": "age", "range": [18.0, 65.0]}), universe)
    assert query.key == "count:age=1-2"


# -- explicit weights and the grid -------------------------------------------------------------


def test_sparse_weights(universe, data):
    hist, counts = data
    (query,) = parse_query(
        {"schema": S, "kind": "weights", "sparse": {"17": 0.25, "3": 1.0, "100": 0, "5": 1e-9}},
        universe,
    )
    w = np.zeros(universe.size)
    w[17], w[3] = 0.25, 1.0
    np.testing.assert_array_equal(query.dense_weights(), w)
    assert query.support_size == 2  # 0 and a weight that rounds to 0 are not support
    assert query.key.startswith("weights:2:") and "0.25" not in query.key
    assert query.weighted_count(counts) == 16384 * int(counts[17]) + 65536 * int(counts[3])
    check_against_dense(query, hist, counts)
    (empty,) = parse_query({"schema": S, "kind": "weights", "sparse": {}}, universe)
    assert empty.support_size == 0 and empty.weighted_sum(hist) == 0.0
    check_against_dense(empty, hist, counts)


def test_dense_weights(universe, data):
    hist, counts = data
    rng = np.random.default_rng(2)
    raw = rng.random(universe.size)
    raw[rng.random(universe.size) < 0.3] = 0.0
    raw[:3] = [0, 1, 1]  # ints are numbers too
    weights = [int(x) if i < 3 else float(x) for i, x in enumerate(raw)]
    (query,) = parse_query({"schema": S, "kind": "weights", "weights": weights}, universe)
    expected = np.rint(raw * 2**16) / 2**16
    np.testing.assert_array_equal(query.dense_weights(), expected)
    check_against_dense(query, hist, counts)
    # the same weights given sparsely compile to the same key
    sparse = {str(i): float(x) for i, x in enumerate(raw) if x > 0}
    (again,) = parse_query({"schema": S, "kind": "weights", "sparse": sparse}, universe)
    assert again.key == query.key
    # a numpy array is accepted from Python callers
    (arr,) = parse_query({"schema": S, "kind": "weights", "weights": raw}, universe)
    assert arr.key == query.key


def test_small_dense_support_uses_the_sparse_form(universe, data):
    hist, counts = data
    weights = [0.0] * universe.size
    weights[7] = 0.5
    (query,) = parse_query({"schema": S, "kind": "weights", "weights": weights}, universe)
    assert query.support_size == 1
    check_against_dense(query, hist, counts)


def test_weight_rounding_value_and_bound(universe):
    (query,) = parse_query({"schema": S, "kind": "weights", "sparse": {"0": 0.3}}, universe)
    assert query.dense_weights()[0] == round(0.3 * 65536) / 65536 == 19661 / 65536
    # round half to even on the grid
    (q,) = parse_query(
        {"schema": S, "kind": "weights", "sparse": {"0": 0.5 / 65536, "1": 1.5 / 65536}},
        universe,
    )
    assert q.dense_weights()[:2].tolist() == [0.0, 2 / 65536]
    # |w - rounded| <= 2^-17 per weight, so the answer moves by <= 2^-17 on any normalised x
    rng = np.random.default_rng(9)
    raw = rng.random(universe.size)
    (dense,) = parse_query({"schema": S, "kind": "weights", "weights": raw.tolist()}, universe)
    rounded = dense.dense_weights()
    assert np.all(rounded >= 0) and np.all(rounded <= 1)
    assert np.max(np.abs(rounded - raw)) <= 2.0**-17
    for _ in range(20):
        x = rng.dirichlet(np.ones(universe.size))
        assert abs(dense.weighted_sum(x) - float(raw @ x)) <= 2.0**-17 + 1e-15
    # sensitivity: one event more in any cell moves sum(units * counts) by at most 2^16
    counts = rng.integers(0, 100, universe.size)
    base = dense.weighted_count(counts)
    for cell in rng.choice(universe.size, 20, replace=False):
        bumped = counts.copy()
        bumped[cell] += 1
        assert 0 <= dense.weighted_count(bumped) - base <= WEIGHT_UNIT


def test_predicates_are_not_rounded(universe):
    (query,) = parse_query(count({"attr": "country", "eq": "de"}), universe)
    assert set(np.unique(query.dense_weights())) == {0.0, 1.0}
    assert set(np.unique(exact_units(query))) == {0, WEIGHT_UNIT}


# -- exactness of weighted_count ----------------------------------------------------------------


def test_weighted_count_is_exact_with_huge_counts(universe):
    rng = np.random.default_rng(4)
    counts = rng.integers(2**39, 2**40, universe.size)
    counts[:5] = 2**40 - 1
    raw = rng.random(universe.size)
    queries = [
        parse_query({"schema": S, "kind": "weights", "weights": raw.tolist()}, universe)[0],
        parse_query(
            {"schema": S, "kind": "weights", "sparse": {str(i): 0.7 + i / 1e4 for i in range(40)}},
            universe,
        )[0],
        parse_query(count({"attr": "device", "in": ["ios", "web"]}), universe)[0],
    ]
    for query in queries:
        units = exact_units(query)
        exact = sum(int(u) * int(c) for u, c in zip(units, counts, strict=True))
        assert query.weighted_count(counts) == exact
        assert exact > 2**53  # float64 could not hold it
        as_float = float(np.dot(units.astype(float), counts.astype(float)))
        assert int(as_float) != exact or exact % 2**10 == 0
        # and the normalised answer agrees with the exact fraction
        assert query.weighted_count(counts) / (WEIGHT_UNIT * int(counts.sum())) == pytest.approx(
            float(Fraction(exact, WEIGHT_UNIT * int(counts.sum()))), rel=1e-15
        )


def test_weighted_count_small_fast_path_equals_python(universe, data):
    _, counts = data
    (query,) = parse_query(
        {"schema": S, "kind": "weights", "weights": np.linspace(0, 1, universe.size).tolist()},
        universe,
    )
    units = exact_units(query)
    assert query.weighted_count(counts) == sum(
        int(u) * int(c) for u, c in zip(units, counts, strict=True)
    )
    assert type(query.weighted_count(counts)) is int


# -- argument checks and immutability ---------------------------------------------------------


def test_array_arguments_are_checked(universe, data):
    hist, counts = data
    (query,) = parse_query(count({"attr": "country", "eq": "de"}), universe)
    with pytest.raises(InvalidParameterError, match=r"counts must be a numpy int64 array of shape"):
        query.weighted_count(counts.astype(np.int32))
    with pytest.raises(InvalidParameterError, match=r"counts must be a numpy int64 array"):
        query.weighted_count(counts.tolist())
    with pytest.raises(InvalidParameterError, match=r"values must be a numpy float64 array"):
        query.weighted_sum(hist[:-1])
    with pytest.raises(InvalidParameterError, match="writeable C-contiguous"):
        query.multiply(np.repeat(hist, 2)[::2], 0.1)
    frozen = hist.copy()
    frozen.flags.writeable = False
    with pytest.raises(InvalidParameterError, match="writeable C-contiguous"):
        query.multiply(frozen, 0.1)
    for bad in (math.inf, math.nan, "0.1", True, 701.0, -1e6, 10**400):
        with pytest.raises(InvalidParameterError, match="log_factor must be a finite number"):
            query.multiply(hist.copy(), bad)
    values = hist.copy()
    query.multiply(values, np.float32(0.5))  # numpy numbers are numbers
    query.multiply(values, 700)


def test_compiled_queries_are_immutable(universe):
    for obj in (
        count({"attr": "country", "eq": "de"}),
        {"schema": S, "kind": "weights", "sparse": {"1": 0.5}},
    ):
        (query,) = parse_query(obj, universe)
        with pytest.raises(AttributeError, match="immutable"):
            query.key = "x"
        with pytest.raises(AttributeError, match="immutable"):
            query.support_size = 3
        with pytest.raises(AttributeError):
            del query.key
        weights = query.dense_weights()
        weights[:] = 7.0  # a copy
        assert query.dense_weights().max() <= 1.0
        again = pickle.loads(pickle.dumps(query))
        assert again.key == query.key and again.support_size == query.support_size
        np.testing.assert_array_equal(again.dense_weights(), query.dense_weights())


# -- validation: every error names its path -----------------------------------------------------

BAD_QUERIES = [
    ([1, 2], "query must be an object, got a list"),
    ("count", "query must be an object, got the string 'count'"),
    ({"kind": "count"}, 'query.schema is missing; expected "dpstream.query/1"'),
    (
        {"schema": "dpstream.query/2", "kind": "count"},
        "query.schema 'dpstream.query/2' is an unsupported version",
    ),
    ({"schema": "sql", "kind": "count"}, 'query.schema must be "dpstream.query/1", got the string'),
    ({"schema": 1, "kind": "count"}, 'query.schema must be "dpstream.query/1", got the number 1'),
    ({"schema": S}, 'query.kind is missing; expected one of "count", "marginal", "weights"'),
    ({"schema": S, "kind": "sum"}, "query.kind must be one of"),
    (
        {"schema": S, "kind": None},
        'query.kind must be one of "count", "marginal", "weights", got null',
    ),
    (
        {"schema": S, "kind": "count", "wehre": []},
        "query has unknown key 'wehre'; allowed keys for kind \"count\": schema, kind, where",
    ),
    ({"schema": S, "kind": "count", "attrs": ["a"]}, "query has unknown key 'attrs'"),
    ({"schema": S, "kind": "count", "where": {}}, "query.where must be a list of conditions"),
    (
        {"schema": S, "kind": "count", "where": None},
        "query.where must be a list of conditions, got null",
    ),
    (count("country"), "query.where[0] must be an object like"),
    (count({"eq": "de"}), "query.where[0].attr is missing"),
    (count({"attr": 3, "eq": "de"}), "query.where[0].attr must be a string naming an attribute"),
    (
        count({"attr": "county", "eq": "de"}),
        "query.where[0].attr: unknown attribute 'county'; the universe has 'country', 'device'",
    ),
    (
        count({"attr": "country"}),
        'query.where[0] must have exactly one of "eq", "in", "range", got none',
    ),
    (
        count({"attr": "country", "eq": "de", "in": ["fr"]}),
        'query.where[0] must have exactly one of "eq", "in", "range", got "eq" and "in"',
    ),
    (
        count({"attr": "country", "eq": "de", "not": True}),
        "query.where[0] has unknown key 'not'; allowed keys: attr, eq, in, range",
    ),
    (
        count(
            {"attr": "country", "eq": "de"},
            {"attr": "plan", "eq": "pro"},
            {"attr": "country", "eq": "fr"},
        ),
        "query.where[2].attr: attribute 'country' is already restricted by query.where[0]",
    ),
    (
        count({"attr": "country", "eq": "xx"}),
        "query.where[0].eq: 'xx' is not one of the values of attribute 'country' ('de', 'fr'",
    ),
    (
        count({"attr": "country", "eq": 1}),
        "query.where[0].eq must be a string (a value of attribute 'country'), got the number 1",
    ),
    (
        count({"attr": "country", "in": []}),
        "query.where[0].in must be a non-empty list of values of attribute 'country', got []",
    ),
    (count({"attr": "country", "in": "de"}), "query.where[0].in must be a non-empty list"),
    (
        count({"attr": "country", "in": ["de", "xx"]}),
        "query.where[0].in[1]: 'xx' is not one of the values",
    ),
    (count({"attr": "country", "in": ["de", None]}), "query.where[0].in[1] must be a string"),
    (
        count({"attr": "country", "range": [0, 1]}),
        "query.where[0].range: attribute 'country' is categorical",
    ),
    (
        count({"attr": "age", "eq": 18}),
        "query.where[0].eq: attribute 'age' is bucketed; "
        'select its buckets with "range": [lo, hi]',
    ),
    (count({"attr": "age", "in": [18]}), "query.where[0].in: attribute 'age' is bucketed"),
    (
        count({"attr": "age", "range": 18}),
        "query.where[0].range must be a list [lo, hi] of two bucket edges",
    ),
    (count({"attr": "age", "range": [18]}), "query.where[0].range must be a list [lo, hi]"),
    (count({"attr": "age", "range": [18, 30, 65]}), "query.where[0].range must be a list [lo, hi]"),
    (
        count({"attr": "age", "range": [17, 65]}),
        "query.where[0].range[0]: 17 is not a bucket edge of attribute 'age'; "
        "the nearest edges are 0 and 18",
    ),
    (
        count({"attr": "age", "range": [18, 64.5]}),
        "query.where[0].range[1]: 64.5 is not a bucket edge of attribute 'age'; "
        "the nearest edges are 30 and 65",
    ),
    (
        count({"attr": "age", "range": [-5, 18]}),
        "query.where[0].range[0]: -5 is not a bucket edge of attribute 'age'; "
        "the nearest edge is the first, 0",
    ),
    (
        count({"attr": "age", "range": [18, 200]}),
        "query.where[0].range[1]: 200 is not a bucket edge of attribute 'age'; "
        "the nearest edge is the last, 120",
    ),
    (
        count({"attr": "age", "range": [65, 18]}),
        "query.where[0].range must have lo < hi, got [65, 18]",
    ),
    (count({"attr": "age", "range": [18, 18]}), "query.where[0].range must have lo < hi"),
    (
        count({"attr": "age", "range": ["18", 65]}),
        "query.where[0].range[0] must be a finite number (a bucket edge of attribute 'age'), "
        "got the string '18'",
    ),
    (
        count({"attr": "age", "range": [True, 65]}),
        "query.where[0].range[0] must be a finite number",
    ),
    (
        count({"attr": "age", "range": [0, math.inf]}),
        "query.where[0].range[1] must be a finite number",
    ),
    (
        count({"attr": "age", "range": [0, 10**400]}),
        "query.where[0].range[1] must be a finite number",
    ),
    ({"schema": S, "kind": "marginal"}, "query.attrs is missing"),
    (
        {"schema": S, "kind": "marginal", "attrs": []},
        "query.attrs must be a non-empty list of attribute names, got []",
    ),
    ({"schema": S, "kind": "marginal", "attrs": "country"}, "query.attrs must be a non-empty list"),
    (
        {"schema": S, "kind": "marginal", "attrs": ["country", "x"]},
        "query.attrs[1]: unknown attribute 'x'",
    ),
    (
        {"schema": S, "kind": "marginal", "attrs": ["country", "plan", "country"]},
        "query.attrs[2]: attribute 'country' is listed twice (also query.attrs[0])",
    ),
    (
        {"schema": S, "kind": "marginal", "attrs": ["plan"], "where": [{"attr": "x", "eq": "1"}]},
        "query.where[0].attr: unknown attribute 'x'",
    ),
    ({"schema": S, "kind": "weights"}, 'query must have exactly one of "weights"'),
    (
        {"schema": S, "kind": "weights", "weights": [], "sparse": {}},
        'query must have exactly one of "weights" (a list with one weight per cell) or "sparse" '
        "(an object mapping cell indices to weights), got both",
    ),
    (
        {"schema": S, "kind": "weights", "weights": {"0": 1}},
        "query.weights must be a list of 120 numbers in [0, 1], got an object",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0.5] * 119},
        "query.weights has 119 entries; expected one per cell of the universe (120)",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0.5] * 17 + [1.5] + [0] * 102},
        "query.weights[17] must be a number in [0, 1], got the number 1.5",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0.5] * 3 + [-0.0001] + [0] * 116},
        "query.weights[3] must be a number in [0, 1]",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0] * 5 + [math.nan] + [0] * 114},
        "query.weights[5] must be a number in [0, 1], got the number nan",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0] * 5 + [math.inf] + [0] * 114},
        "query.weights[5] must be a number in [0, 1]",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0] * 9 + ["0.5"] + [0] * 110},
        "query.weights[9] must be a number in [0, 1], got the string '0.5'",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0] * 9 + [True] + [0] * 110},
        "query.weights[9] must be a number in [0, 1], got a boolean",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0] * 9 + [10**400] + [0] * 110},
        "query.weights[9] must be a number in [0, 1]",
    ),
    (
        {"schema": S, "kind": "weights", "weights": [0] * 9 + [None] + [0] * 110},
        "query.weights[9] must be a number in [0, 1], got null",
    ),
    (
        {"schema": S, "kind": "weights", "weights": np.full(120, 2.0)},
        "query.weights[0] must be a number in [0, 1], got the number 2.0",
    ),
    (
        {"schema": S, "kind": "weights", "sparse": [1]},
        "query.sparse must be an object mapping cell indices",
    ),
    (
        {"schema": S, "kind": "weights", "sparse": {"x": 1}},
        'query.sparse["x"]: the key must be a cell index, a decimal integer in [0, 120)',
    ),
    (
        {"schema": S, "kind": "weights", "sparse": {"017": 1}},
        'query.sparse["017"]: the key must be a cell index',
    ),
    (
        {"schema": S, "kind": "weights", "sparse": {"-1": 1}},
        'query.sparse["-1"]: the key must be a cell index',
    ),
    (
        {"schema": S, "kind": "weights", "sparse": {"120": 1}},
        'query.sparse["120"]: cell index 120 is outside [0, 120)',
    ),
    (
        {"schema": S, "kind": "weights", "sparse": {"1": 1.25}},
        'query.sparse["1"] must be a number in [0, 1], got the number 1.25',
    ),
    (
        {"schema": S, "kind": "weights", "sparse": {"1": "1"}},
        'query.sparse["1"] must be a number in [0, 1]',
    ),
    (
        {"schema": S, "kind": "weights", "sparse": {1: 1}},
        "query.sparse[1]: the key must be a cell index",
    ),
]


@pytest.mark.parametrize(("obj", "message"), BAD_QUERIES)
def test_validation_errors(universe, obj, message):
    with pytest.raises(QueryError) as info:
        parse_query(obj, universe)
    assert str(info.value).startswith(message), str(info.value)
    with pytest.raises(QueryError):
        QueryCompiler(universe).compile(obj)


# -- the compiler cache -----------------------------------------------------------------------


def test_cache_returns_the_same_objects(universe):
    compiler = QueryCompiler(universe)
    a = compiler.compile(count({"attr": "country", "eq": "de"}, {"attr": "age", "range": [18, 65]}))
    # same JSON with keys in another order and ints as written: a cache hit
    b = compiler.compile(
        {
            "where": [{"eq": "de", "attr": "country"}, {"range": [18, 65], "attr": "age"}],
            "kind": "count",
            "schema": S,
        }
    )
    assert a[0] is b[0] and a is not b
    assert compiler.hits == 1 and compiler.misses == 1 and len(compiler) == 1
    m1 = compiler.compile({"schema": S, "kind": "marginal", "attrs": ["plan", "device"]})
    m2 = compiler.compile({"schema": S, "kind": "marginal", "attrs": ["plan", "device"]})
    assert len(m1) == 6 and all(x is y for x, y in zip(m1, m2, strict=True))
    m2.clear()  # the caller's list, not the cache's
    assert (
        len(compiler.compile({"schema": S, "kind": "marginal", "attrs": ["plan", "device"]})) == 6
    )
    w1 = compiler.compile({"schema": S, "kind": "weights", "sparse": {"1": 0.5, "3": 1}})
    w2 = compiler.compile({"schema": S, "kind": "weights", "sparse": {"3": 1.0, "1": 0.5}})
    assert w1[0] is w2[0]
    compiler.clear()
    assert len(compiler) == 0
    assert (
        compiler.compile(
            count({"attr": "country", "eq": "de"}, {"attr": "age", "range": [18, 65]})
        )[0]
        is not a[0]
    )


def test_cache_is_lru_and_bounds_dense_entries(universe):
    compiler = QueryCompiler(universe, max_entries=2, max_dense=1)
    q = [count({"attr": "country", "eq": c}) for c in ("de", "fr", "it")]
    first = compiler.compile(q[0])[0]
    compiler.compile(q[1])
    assert compiler.compile(q[0])[0] is first  # refreshes q[0]
    compiler.compile(q[2])  # evicts q[1], the least recently used
    assert compiler.compile(q[0])[0] is first
    assert len(compiler) == 2
    rng = np.random.default_rng(0)
    dense1 = {"schema": S, "kind": "weights", "weights": rng.random(universe.size).tolist()}
    dense2 = {"schema": S, "kind": "weights", "weights": rng.random(universe.size).tolist()}
    d1 = compiler.compile(dense1)[0]
    assert compiler.compile(dense1)[0] is d1
    compiler.compile(dense2)  # only one dense entry is kept
    assert compiler.compile(dense1)[0] is not d1
    assert len(compiler) <= 2
    no_dense = QueryCompiler(universe, max_dense=0)
    assert no_dense.compile(dense1)[0] is not no_dense.compile(dense1)[0]
    with pytest.raises(InvalidParameterError, match="max_entries must be an integer >= 1"):
        QueryCompiler(universe, max_entries=0)
    with pytest.raises(InvalidParameterError, match="max_dense must be an integer >= 0"):
        QueryCompiler(universe, max_dense=-1)


# -- junk never escapes as anything but QueryError -------------------------------------------


def _mutations(rng, obj, depth=0):
    """Yield variants of a valid query with one part replaced by junk."""
    junk = [
        None,
        True,
        0,
        -1,
        1.5,
        math.nan,
        math.inf,
        10**30,
        10**400,
        "",
        "x",
        "de",
        [],
        {},
        [[]],
        {"": None},
        [1, "a"],
        ["de"],
        {"0": 2},
        2**63,
    ]
    yield junk[rng.integers(len(junk))]
    if isinstance(obj, dict):
        for key in list(obj):
            changed = dict(obj)
            if rng.random() < 0.3:
                del changed[key]
            else:
                changed[key] = next(_mutations(rng, obj[key], depth + 1))
            yield changed
        changed = dict(obj)
        keys = [None, 0, 1.5, "", "x", "extra", "attr", "eq"]
        changed[keys[rng.integers(len(keys))]] = 1
        yield changed
    elif isinstance(obj, list):
        for i in range(len(obj)):
            changed = list(obj)
            changed[i] = next(_mutations(rng, obj[i], depth + 1))
            yield changed
        yield obj + [junk[rng.integers(len(junk))]]
        yield obj[:-1]


VALID = [
    count(
        {"attr": "country", "eq": "de"},
        {"attr": "device", "in": ["ios", "web"]},
        {"attr": "age", "range": [18, 65]},
    ),
    {
        "schema": S,
        "kind": "marginal",
        "attrs": ["country", "plan"],
        "where": [{"attr": "age", "range": [0, 30]}],
    },
    {"schema": S, "kind": "weights", "sparse": {"17": 0.25, "4": 1.0}},
    {"schema": S, "kind": "weights", "weights": [0.5] * 120},
]


def _check_no_other_exception(universe, obj):
    try:
        result = parse_query(obj, universe)
    except QueryError as exc:
        assert str(exc)
        return
    assert isinstance(result, list) and all(isinstance(q, LinearQuery) for q in result)


def test_mutated_queries_raise_only_query_error(universe):
    rng = np.random.default_rng(123)
    compiler = QueryCompiler(universe, max_entries=8)
    for _ in range(60):
        for valid in VALID:
            frontier = [valid]
            for _round in range(3):
                nxt = []
                for obj in frontier:
                    for variant in _mutations(rng, obj):
                        _check_no_other_exception(universe, variant)
                        try:
                            compiler.compile(variant)
                        except QueryError:
                            pass
                        nxt.append(variant)
                frontier = [nxt[i] for i in rng.choice(len(nxt), min(4, len(nxt)), replace=False)]


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test extra
    given = None

if given is not None:
    _scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(
            [
                "count",
                "marginal",
                "weights",
                S,
                "country",
                "age",
                "de",
                "attr",
                "eq",
                "in",
                "range",
                "17",
            ]
        ),
        st.text(max_size=5),
    )
    _json = st.recursive(
        _scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(
                st.sampled_from(
                    [
                        "schema",
                        "kind",
                        "where",
                        "attrs",
                        "weights",
                        "sparse",
                        "attr",
                        "eq",
                        "in",
                        "range",
                        "0",
                        "x",
                    ]
                ),
                inner,
                max_size=5,
            ),
        ),
        max_leaves=20,
    )
    _queries = st.fixed_dictionaries(
        {
            "schema": st.sampled_from([S, "dpstream.query/0"]),
            "kind": st.sampled_from(["count", "marginal", "weights"]),
        },
        optional={"where": _json, "attrs": _json, "sparse": _json, "weights": _json},
    )

    @settings(max_examples=400, deadline=None)
    @given(obj=st.one_of(_json, _queries))
    def test_hypothesis_junk_raises_only_query_error(universe, obj):
        _check_no_other_exception(universe, obj)
