"""The PMWG data universe: schema validation, record -> cell mapping, digest."""

import math
import pickle

import numpy as np
import pytest

from dpstream.core.pmwg.attributes import Bucketed, Categorical, UniverseError
from dpstream.core.pmwg.universe import MAX_CELLS, Universe
from dpstream.errors import InvalidParameterError

SPEC = [
    {"name": "country", "values": ["de", "fr", "it"]},
    {"name": "age", "edges": [0, 18, 30, 65, 120]},
    {"name": "device", "values": ["ios", "android"]},
]


@pytest.fixture
def universe():
    return Universe.from_spec(SPEC)


def test_shape_size_and_names(universe):
    assert universe.shape == (3, 4, 2)
    assert universe.size == 24
    assert universe.names == ("country", "age", "device")
    assert universe.position("age") == 1
    assert universe.attribute("device") == Categorical("device", ("ios", "android"))
    assert universe.attribute("age").edges == (0.0, 18.0, 30.0, 65.0, 120.0)
    assert Universe.MAX_CELLS == MAX_CELLS == 2**24
    assert Universe.from_spec(universe.to_spec()) == universe
    again = pickle.loads(pickle.dumps(universe))
    assert again == universe and hash(again) == hash(universe)
    assert again.digest() == universe.digest() and again.shape == universe.shape
    assert again.cells([{"country": "it", "age": 120, "device": "android"}])[0].tolist() == [23]


def test_error_type_is_an_invalid_parameter_error():
    assert issubclass(UniverseError, InvalidParameterError)


def test_cells_match_ravel_multi_index(universe):
    rng = np.random.default_rng(7)
    countries, devices = ["de", "fr", "it"], ["ios", "android"]
    ages = [0, 5, 17.5, 18, 29, 30, 64.999, 65, 100, 120]
    age_bucket = [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
    records, expected = [], []
    for _ in range(500):
        c, a, d = rng.integers(3), rng.integers(len(ages)), rng.integers(2)
        records.append({"device": devices[d], "country": countries[c], "age": ages[a]})
        expected.append(np.ravel_multi_index((c, age_bucket[a], d), (3, 4, 2)))
    cells, bad = universe.cells(records)
    assert bad == []
    assert cells.dtype == np.int64
    np.testing.assert_array_equal(cells, expected)
    # by hand: first attribute most significant
    assert universe.cells([{"country": "it", "age": 120, "device": "android"}])[0][0] == 23
    assert universe.cells([{"country": "fr", "age": 18, "device": "ios"}])[0][0] == 1 * 8 + 1 * 2


@pytest.mark.parametrize(
    ("age", "bucket"),
    [
        (0, 0),
        (0.0, 0),
        (17.999999, 0),
        (18, 1),
        (29.9, 1),
        (30, 2),
        (64.99, 2),
        (65, 3),
        (119.5, 3),
        (120, 3),  # the last bucket is closed on both sides
        (120.0, 3),
    ],
)
def test_bucket_edges_are_left_closed_and_the_last_is_closed(universe, age, bucket):
    cells, bad = universe.cells([{"country": "de", "age": age, "device": "ios"}])
    assert bad == []
    assert cells.tolist() == [bucket * 2]
    assert universe.attribute("age").code(age) == bucket
    # the numpy column path agrees
    cells2, mask, _ = universe.cell_of_columns(
        {"country": np.array(["de"]), "age": np.array([age], dtype=float), "device": ["ios"]}
    )
    assert cells2.tolist() == [bucket * 2] and not mask.any()


def _reason(universe, record):
    cells, bad = universe.cells([record])
    assert cells.size == 0
    ((index, reason),) = bad
    assert index == 0
    return reason


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (
            {"country": "de", "age": 130, "device": "ios"},
            "attribute 'age': value 130 outside [0, 120]",
        ),
        (
            {"country": "de", "age": -0.5, "device": "ios"},
            "attribute 'age': value -0.5 outside [0, 120]",
        ),
        (
            {"country": "de", "age": 120.000001, "device": "ios"},
            "attribute 'age': value 120.000001 outside [0, 120]",
        ),
        (
            {"country": "de", "age": math.inf, "device": "ios"},
            "attribute 'age': value inf outside [0, 120]",
        ),
        (
            {"country": "de", "age": math.nan, "device": "ios"},
            "attribute 'age': value nan is not a number",
        ),
        ({"country": "de", "age": 10**400, "device": "ios"}, "attribute 'age': value 1000"),
        ({"country": "de", "age": "30", "device": "ios"}, "attribute 'age': '30' is not a number"),
        ({"country": "de", "age": True, "device": "ios"}, "attribute 'age': True is not a number"),
        ({"country": "de", "age": None, "device": "ios"}, "attribute 'age': None is not a number"),
        ({"country": "de", "device": "ios"}, "attribute 'age' missing"),
        (
            {"country": "xx", "age": 3, "device": "ios"},
            "attribute 'country': 'xx' is not one of the declared values",
        ),
        (
            {"country": 1, "age": 3, "device": "ios"},
            "attribute 'country': 1 (a int) is not one of the declared values",
        ),
        (
            {"country": ["de"], "age": 3, "device": "ios"},
            "attribute 'country': ['de'] (a list) is not one of the declared values",
        ),
        ({"age": 3, "device": "ios"}, "attribute 'country' missing"),
        (["de", 3, "ios"], "record is not an object"),
        (None, "record is not an object"),
    ],
)
def test_every_failure_reason(universe, record, reason):
    assert _reason(universe, record).startswith(reason)


def test_reason_names_the_first_failing_attribute_and_values_are_cut(universe):
    reason = _reason(universe, {"country": "x" * 1000, "age": 500, "device": "pc"})
    assert reason.startswith("attribute 'country': 'xxx")
    assert len(reason) < 200


def test_mixed_batch_keeps_order_of_good_cells(universe):
    records = [
        {"country": "fr", "age": 120, "device": "ios"},
        {"country": "xx", "age": 3, "device": "ios"},
        {"country": "de", "age": 130, "device": "ios"},
        {"country": "it", "age": 18.0, "device": "android"},
        {"country": "de", "device": "ios"},
        {"country": "de", "age": np.float64(20), "device": "ios"},  # numpy scalars are fine
        {"country": "de", "age": np.int32(20), "device": np.str_("android")},
    ]
    cells, bad = universe.cells(records)
    assert cells.tolist() == [14, 19, 2, 3]
    assert [i for i, _ in bad] == [1, 2, 4]


def test_empty_batch(universe):
    cells, bad = universe.cells([])
    assert cells.shape == (0,) and bad == []


def test_cell_of_columns(universe):
    columns = {
        "country": np.array(["de", "it", "zz", "fr"]),
        "age": np.array([0, 64.9, 20, 200]),
        "device": ["ios", "android", "ios", "ios"],
    }
    cells, bad, reasons = universe.cell_of_columns(columns)
    assert cells.tolist() == [0, 21, -1, -1]
    assert bad.tolist() == [False, False, True, True]
    assert reasons == [
        (2, "attribute 'country': 'zz' is not one of the declared values"),
        (3, "attribute 'age': value 200 outside [0, 120]"),
    ]
    # object and list columns give the same answer
    cells2, bad2, reasons2 = universe.cell_of_columns(
        {name: list(col) for name, col in columns.items()}
    )
    assert cells2.tolist() == [0, 21, -1, -1] and bad2.tolist() == bad.tolist()
    assert [i for i, _ in reasons2] == [2, 3]
    # a missing column marks every row bad
    _, bad3, reasons3 = universe.cell_of_columns({"country": ["de"], "age": [1]})
    assert bad3.tolist() == [True] and reasons3 == [(0, "attribute 'device' missing")]
    with pytest.raises(UniverseError, match="same length"):
        universe.cell_of_columns({"country": ["de"], "age": [1, 2], "device": ["ios"]})


def test_cell_of_columns_matches_cells_on_random_batches(universe):
    rng = np.random.default_rng(3)
    countries = np.array(["de", "fr", "it", "nl"])
    ages = rng.uniform(-10, 130, 2000)
    cols = {
        "country": countries[rng.integers(0, 4, 2000)],
        "age": ages,
        "device": np.array(["ios", "android"])[rng.integers(0, 2, 2000)],
    }
    cells, bad, reasons = universe.cell_of_columns(cols)
    records = [
        {"country": str(c), "age": float(a), "device": str(d)}
        for c, a, d in zip(cols["country"], cols["age"], cols["device"], strict=True)
    ]
    good_cells, bad_records = universe.cells(records)
    np.testing.assert_array_equal(good_cells, cells[~bad])
    assert [i for i, _ in bad_records] == np.flatnonzero(bad).tolist()
    assert [i for i, _ in reasons] == np.flatnonzero(bad).tolist()


def test_describe_cell(universe):
    assert universe.describe_cell(0) == {"country": "de", "age": "[0, 18)", "device": "ios"}
    assert universe.describe_cell(23) == {"country": "it", "age": "[65, 120]", "device": "android"}
    assert universe.describe_cell(np.int64(11)) == {
        "country": "fr",
        "age": "[18, 30)",
        "device": "android",
    }
    for bad in (-1, 24, 1.0, True, "3"):
        with pytest.raises(UniverseError, match=r"cell index must be an integer in \[0, 24\)"):
            universe.describe_cell(bad)


def test_bucket_labels_with_fractional_edges():
    attr = Bucketed("x", (0.5, 1, 2.25))
    assert attr.label(0) == "[0.5, 1)" and attr.label(1) == "[1, 2.25]"


def test_max_cells():
    ok = Universe(tuple(Categorical(f"a{i}", ("x", "y")) for i in range(24)))
    assert ok.size == MAX_CELLS
    with pytest.raises(UniverseError) as info:
        Universe(tuple(Categorical(f"a{i}", ("x", "y")) for i in range(25)))
    message = str(info.value)
    assert "33554432 cells" in message
    assert "16777216" in message and "2^24" in message
    assert "dense histograms are supported up to 2^24 cells" in message


def test_a_2_20_universe_works():
    spec = [{"name": f"a{i}", "values": [f"v{j}" for j in range(16)]} for i in range(4)]
    spec.append({"name": "x", "edges": list(range(17))})
    universe = Universe.from_spec(spec)
    assert universe.size == 2**20
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(5, 1000))
    records = [
        {**{f"a{i}": f"v{codes[i, r]}" for i in range(4)}, "x": float(codes[4, r]) + 0.5}
        for r in range(1000)
    ]
    cells, bad = universe.cells(records)
    assert bad == []
    np.testing.assert_array_equal(cells, np.ravel_multi_index(tuple(codes), universe.shape))
    assert universe.describe_cell(2**20 - 1) == {
        "a0": "v15",
        "a1": "v15",
        "a2": "v15",
        "a3": "v15",
        "x": "[15, 16]",
    }


def test_digest_is_stable_and_sensitive(universe):
    digest = universe.digest()
    assert len(digest) == 64 and int(digest, 16) >= 0
    # pinned: a change here breaks the binding of every stored mechanism state
    assert digest == "193f427bcd59296a0a686c1c85d749c1118da71a7b2ca7f2b6105126d9350a8e"
    assert Universe.from_spec(SPEC).digest() == digest
    # 18 and 18.0 are the same edge
    same = [dict(SPEC[0]), {"name": "age", "edges": [0.0, 18.0, 30, 65, 120.0]}, dict(SPEC[2])]
    assert Universe.from_spec(same).digest() == digest
    variants = [
        [{"name": "Country", "values": ["de", "fr", "it"]}, SPEC[1], SPEC[2]],
        [{"name": "country", "values": ["de", "fr", "it", "nl"]}, SPEC[1], SPEC[2]],
        [{"name": "country", "values": ["fr", "de", "it"]}, SPEC[1], SPEC[2]],
        [SPEC[0], {"name": "age", "edges": [0, 18, 30, 65, 121]}, SPEC[2]],
        [SPEC[0], {"name": "age", "edges": [0, 18, 30, 120]}, SPEC[2]],
        [SPEC[0], SPEC[2], SPEC[1]],
        [SPEC[0], SPEC[1]],
        [SPEC[0], {"name": "age", "values": ["0", "18", "30", "65", "120"]}, SPEC[2]],
    ]
    digests = {Universe.from_spec(v).digest() for v in variants}
    assert len(digests) == len(variants) and digest not in digests


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "universe must be a non-empty list of attribute objects, got a dict"),
        ([], "universe must be a non-empty list of attribute objects, got []"),
        (["x"], 'universe[0] must be an object with "name" and "values" or "edges", got a str'),
        ([{"values": ["a"]}], 'universe[0].name is missing; every attribute needs a "name"'),
        ([{"name": 3, "values": ["a"]}], "universe[0].name must be a string matching"),
        ([{"name": "1x", "values": ["a"]}], "universe[0].name must match [A-Za-z_]"),
        ([{"name": "a" * 65, "values": ["a"]}], "universe[0].name must match"),
        ([{"name": "a-b", "values": ["a"]}], "universe[0].name must match"),
        (
            [{"name": "a", "values": ["x"]}, {"name": "a", "values": ["y"]}],
            "universe[1].name 'a' is already used by universe[0]; names must be unique",
        ),
        (
            [{"name": "a", "values": ["x"], "edges": [0, 1]}],
            'universe[0] must have exactly one of "values" (categorical) or "edges" (bucketed), '
            "got both",
        ),
        ([{"name": "a"}], 'universe[0] must have exactly one of "values"'),
        (
            [{"name": "a", "values": ["x"], "size": 3}],
            "universe[0] has unknown key 'size'; allowed keys: name, values, edges",
        ),
        ([{"name": "a", "values": []}], "universe[0].values must be a non-empty list"),
        ([{"name": "a", "values": "xy"}], "universe[0].values must be a non-empty list"),
        ([{"name": "a", "values": ["x", 1]}], "universe[0].values[1] must be a string, got 1"),
        (
            [{"name": "a", "values": ["x", "y", "x"]}],
            "universe[0].values[2] 'x' repeats universe[0].values[0]; values must be distinct",
        ),
        ([{"name": "a", "edges": [1]}], "universe[0].edges must have at least 2 edges (1 bucket)"),
        ([{"name": "a", "edges": 5}], "universe[0].edges must be a list"),
        (
            [{"name": "a", "edges": [0, 18, 18, 30]}],
            "universe[0].edges must be strictly increasing, got [0, 18, 18, 30]",
        ),
        ([{"name": "a", "edges": [5, 1]}], "universe[0].edges must be strictly increasing"),
        (
            [{"name": "a", "edges": [0, math.inf]}],
            "universe[0].edges[1] must be a finite number, got inf",
        ),
        ([{"name": "a", "edges": [math.nan, 1]}], "universe[0].edges[0] must be a finite number"),
        ([{"name": "a", "edges": [0, 10**400]}], "universe[0].edges[1] must be a finite number"),
        ([{"name": "a", "edges": [False, True]}], "universe[0].edges[0] must be a finite number"),
        ([{"name": "a", "edges": ["0", "1"]}], "universe[0].edges[0] must be a finite number"),
    ],
)
def test_from_spec_errors(spec, message):
    with pytest.raises(UniverseError) as info:
        Universe.from_spec(spec)
    assert str(info.value).startswith(message), str(info.value)


def test_from_spec_path_prefix():
    with pytest.raises(UniverseError, match=r"^pmwg\.universe\[0\]\.values must"):
        Universe.from_spec([{"name": "a", "values": []}], path="pmwg.universe")


def test_direct_construction_is_validated():
    assert Categorical("ok", ["a", "b"]).values == ("a", "b")  # lists become tuples
    assert Categorical("_" + "a" * 63, ("x",)).size == 1
    assert Bucketed("b", (0, 1, 2)).size == 2
    with pytest.raises(UniverseError, match="attribute 'c' values must be a non-empty list"):
        Categorical("c", ())
    with pytest.raises(UniverseError, match="repeats"):
        Categorical("c", ("x", "x"))
    with pytest.raises(UniverseError, match="attribute name must match"):
        Categorical("no way", ("x",))
    with pytest.raises(UniverseError, match="attribute 'b' edges must be strictly increasing"):
        Bucketed("b", (0, 0))
    with pytest.raises(UniverseError, match="at least 2 edges"):
        Bucketed("b", (0,))
    with pytest.raises(UniverseError, match="non-empty tuple of attributes"):
        Universe(())
    with pytest.raises(UniverseError, match=r"attributes\[1\] must be a Categorical or a Bucketed"):
        Universe((Categorical("a", ("x",)), "b"))  # type: ignore[arg-type]
    with pytest.raises(UniverseError, match=r"attributes\[1\] name 'a' is already used"):
        Universe((Categorical("a", ("x",)), Bucketed("a", (0, 1))))
    with pytest.raises(KeyError):
        Bucketed("b", (0, 1)).code(2)
