"""Every registered partitioner (fedgalore.federated.partitioners): one contract for all kinds, each
kind's own invariants, and equality with flwr-datasets' partitioners where we follow them."""
from __future__ import annotations

import numpy as np
import pytest

from fedgalore.federated.partition import PartitionConfig, PartitionError, label_histograms, make_partition, parse_setting
from fedgalore.federated.partitioners import available_partitioners, partitioner_class


def _labels(n=600, k=6, seed=0):
    return np.random.default_rng(seed).integers(0, k, size=n)


def _sites(n=600):
    """An unbalanced site column: 'north' half of the rows, 'south' 30 %, 'east' 20 %."""
    return np.array(["north"] * (n // 2) + ["south"] * (3 * n // 10) + ["east"] * (n - n // 2 - 3 * n // 10))[
        np.random.default_rng(1).permutation(n)]


#: one case per registered kind: (config, the values it splits, num_clients)
CASES = {
    "iid": (PartitionConfig("iid"), _labels(), 7),
    "dirichlet": (PartitionConfig("dirichlet", alpha=0.5, min_size=5), _labels(), 7),
    "natural": (PartitionConfig("natural", column="site"), _sites(), None),
    "files": (PartitionConfig("files"), _sites(), None),
    "pathological": (PartitionConfig("pathological", classes_per_client=2), _labels(), 8),
    "shards": (PartitionConfig("shards", shards_per_client=3), _labels(), 7),
    "quantity": (PartitionConfig("quantity", alpha=0.5, min_size=5), _labels(), 7),
}


def _valid(parts, n):
    assert all(p.dtype == np.int64 and p.ndim == 1 and p.size > 0 for p in parts)
    every = np.concatenate(parts)
    assert every.size == n  # disjoint (no index twice) ...
    np.testing.assert_array_equal(np.sort(every), np.arange(n))  # ... and covering range(N)


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", available_partitioners())
def test_contract_every_registered_partitioner(kind):
    """Disjoint, covering, deterministic given the seed, another split for another seed (unless
    the kind does not use the seed: then the same), no global RNG touched."""
    if partitioner_class(kind).deployment_only:  # nodes: the data never reaches the server, nothing is split
        with pytest.raises(PartitionError, match="runs with the Flower app only"):
            make_partition(_sites(), None, PartitionConfig(kind), seed=3)
        return
    assert kind in CASES, f"partitioner {kind!r} has no contract case here: add one to CASES"
    cfg, values, m = CASES[kind]
    np.random.seed(123)
    expected_global = np.random.random()
    np.random.seed(123)
    parts = make_partition(values, m, cfg, seed=3)
    assert np.random.random() == expected_global
    _valid(parts, values.size)
    assert m is None or len(parts) == m
    assert _same(parts, make_partition(values, m, cfg, seed=3))
    other = make_partition(values, m, cfg, seed=4)
    _valid(other, values.size)
    assert _same(parts, other) is not partitioner_class(kind).seeded


@pytest.mark.parametrize("kind", available_partitioners())
def test_setting_string_round_trip(kind):
    cfg, _, _ = CASES[kind] if kind in CASES else (PartitionConfig(kind), None, None)
    label = cfg.label()
    again = parse_setting(label)
    assert again.label() == label and again.kind == kind
    assert {k: getattr(again, k) for k in cfg.setting_fields()} == cfg.setting_fields()
    by = parse_setting(label + "@type")
    assert by.by == "type" and by.label() == label + "@type" and by.setting_fields()["by"] == "type"


def test_setting_strings_of_the_new_kinds():
    assert parse_setting("natural:site") == PartitionConfig("natural", column="site")
    assert parse_setting("natural:2019").column == "2019"  # a column name, even one that looks like a number
    assert parse_setting("pathological:3").classes_per_client == 3
    assert parse_setting("shards:4").shards_per_client == 4
    assert parse_setting("quantity:0.3") == PartitionConfig("quantity", alpha=0.3)
    assert parse_setting("quantity:power2") == PartitionConfig("quantity", size_skew="power", power=2.0)
    assert parse_setting("Dirichlet:0.5@type") == PartitionConfig("dirichlet", alpha=0.5, by="type")
    for bad, match in [("natural", "unknown partition setting"), ("natural:", "needs the column"),
                       ("iid:2", "takes no parameter"), ("quantity:big", "quantity:<alpha>"),
                       ("shards:x", "shards_per_client must be an integer"), ("uniform", "unknown partition setting")]:
        with pytest.raises(PartitionError, match=match):
            parse_setting(bad)


def test_config_checks_of_the_new_kinds():
    with pytest.raises(PartitionError, match="kind natural needs the column"):
        PartitionConfig("natural")
    with pytest.raises(PartitionError, match="classes_per_client must be >= 1"):
        PartitionConfig("pathological", classes_per_client=0)
    with pytest.raises(PartitionError, match="power must be a finite number >= 0"):
        PartitionConfig("quantity", size_skew="power", power=-1.0)
    with pytest.raises(PartitionError, match=r"only kinds natural and files infer it"):
        make_partition(_labels(), None, PartitionConfig("iid"), 0)


# ----------------------------------------------------------------------------- natural
def test_natural_one_client_per_value_named_by_it():
    sites = _sites()
    cfg = PartitionConfig("natural", column="site")
    parts = make_partition(sites, None, cfg, 0)
    names = cfg.partitioner().names(sites)
    assert names == ["east", "north", "south"]  # sorted distinct values
    for name, part in zip(names, parts):
        np.testing.assert_array_equal(part, np.flatnonzero(sites == name))  # exactly that site's rows, in order
    assert _same(parts, make_partition(sites, 3, cfg, 0))  # a num_clients that agrees is fine


@pytest.mark.parametrize("values, num_clients, match", [
    (_sites(), 20, r"federation.num_clients=20, but column 'site' has 3 distinct values \(east, north, south\).*"
                   "leave federation.num_clients out"),
    (np.array(["A"] * 50), None, r"column='site' has a single value \('A'\) in all 50 training rows.*partition by a column"),
    (np.array(["A", None, "B", "", "A"], dtype=object), None, r"missing in 2 of 5 training rows \(e.g. row 1, 3\)"),
    (np.array([1.0, np.nan, 2.0]), None, "missing in 1 of 3 training rows"),
])
def test_natural_bad_columns_one_line(values, num_clients, match):
    with pytest.raises(PartitionError, match=match) as err:
        make_partition(values, num_clients, PartitionConfig("natural", column="site"), 0)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- pathological, shards, quantity
@pytest.mark.parametrize("mode", ["first-deterministic", "deterministic", "random"])
@pytest.mark.parametrize("c", [1, 2, 4])
def test_pathological_classes_per_client(mode, c):
    y = _labels(900, 6)
    try:
        parts = make_partition(y, 9, PartitionConfig("pathological", classes_per_client=c, class_assignment=mode), 5)
    except PartitionError as err:  # random assignment may leave a class to nobody: refused, never dropped
        assert mode == "random" and "no client holds class" in str(err)
        return
    _valid(parts, y.size)
    assert [len(np.unique(y[p])) for p in parts] == [c] * 9  # exactly C classes each (so <= C)


def test_pathological_refuses_to_drop_a_class():
    y = _labels(300, 6)  # deterministic: clients 0, 1 with 2 classes each cover classes 0..2 only
    with pytest.raises(PartitionError, match=r"no client holds class\(es\) 3, 4, 5.*use at least 6 clients") as err:
        make_partition(y, 2, PartitionConfig("pathological", classes_per_client=2, class_assignment="deterministic"), 0)
    assert "\n" not in str(err.value)
    with pytest.raises(PartitionError, match="exceeds the 6 classes"):
        make_partition(y, 2, PartitionConfig("pathological", classes_per_client=7), 0)


def test_shards_cover_everything_when_shards_do_not_divide():
    y = _labels(601, 5)
    parts = make_partition(y, 7, PartitionConfig("shards", shards_per_client=2), 0)
    _valid(parts, 601)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 2  # 14 shards of 42 or 43 examples, two per client
    assert max(len(np.unique(y[p])) for p in parts) <= 4  # a shard of the class-sorted data spans <= 2 classes
    with pytest.raises(PartitionError, match="shards exceed the 10 examples"):
        make_partition(_labels(10), 4, PartitionConfig("shards", shards_per_client=3), 0)


def test_quantity_skews_sizes_not_labels():
    y = _labels(6000, 6)
    parts = make_partition(y, 10, PartitionConfig("quantity", alpha=0.5, min_size=20), 0)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 20 and sizes.max() > 3 * sizes.min()  # skewed sizes ...
    hist, _ = label_histograms(y, parts)
    big = hist[sizes >= 200]
    tv = 0.5 * np.abs(big / big.sum(1, keepdims=True) - np.bincount(y) / y.size).sum(1)
    assert big.shape[0] >= 2 and tv.max() < 0.1  # ... label mix of the pool (multinomial noise only)
    linear = make_partition(y, 4, PartitionConfig("quantity", size_skew="power", power=1.0), 0)
    assert [len(p) for p in linear] == [600, 1200, 1800, 2400]  # sizes proportional to j + 1
    with pytest.raises(PartitionError, match="leaves client 0 without examples"):
        make_partition(_labels(30), 10, PartitionConfig("quantity", size_skew="power", power=3.0), 0)


# ----------------------------------------------------------------------------- flwr-datasets equivalence
def _flwr_parts(partitioner, columns: dict, shuffle_seed: int | None = None) -> list[np.ndarray]:
    """flwr-datasets' partitions as sorted index arrays (an index column rides along)."""
    datasets = pytest.importorskip("datasets")
    n = len(next(iter(columns.values())))
    ds = datasets.Dataset.from_dict({**{k: list(v) for k, v in columns.items()}, "_i": list(range(n))})
    if shuffle_seed is not None:  # what FederatedDataset(shuffle=True, seed=...) does before partitioning
        ds = ds.shuffle(seed=shuffle_seed)
    partitioner.dataset = ds
    return [np.sort(np.asarray(partitioner.load_partition(i)["_i"])) for i in range(partitioner.num_partitions)]


def _sorted(parts):
    return [np.sort(p) for p in parts]


@pytest.fixture(scope="module")
def flwr():
    return pytest.importorskip("flwr_datasets.partitioner")


def test_natural_equals_flwr_natural_id(flwr):
    sites = _sites()
    ours = make_partition(sites, None, PartitionConfig("natural", column="site"), 0)
    assert _same(ours, _flwr_parts(flwr.NaturalIdPartitioner(partition_by="site"), {"site": sites}))


@pytest.mark.parametrize("mode", ["first-deterministic", "deterministic", "random"])
@pytest.mark.parametrize("labels", [_labels(700, 5, seed=2), np.array(["b", "a", "c", "e", "d"])[_labels(700, 5, seed=2)]])
def test_pathological_equals_flwr(flwr, mode, labels):
    for seed in (0, 7):
        cfg = PartitionConfig("pathological", classes_per_client=2, class_assignment=mode)
        ref = flwr.PathologicalPartitioner(num_partitions=10, partition_by="y", num_classes_per_partition=2,
                                           class_assignment_mode=mode, seed=seed)
        assert _same(_sorted(make_partition(labels, 10, cfg, seed)), _flwr_parts(ref, {"y": labels}))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # pyarrow, inside flwr-datasets' sort
def test_shards_equal_flwr_when_shards_divide(flwr):
    y = _labels(840, 7, seed=3)  # 840 = 10 clients x 3 shards x 28
    for seed in (0, 5):
        ref = flwr.ShardPartitioner(num_partitions=10, partition_by="y", num_shards_per_partition=3, seed=seed)
        ours = make_partition(y, 10, PartitionConfig("shards", shards_per_client=3), seed)
        assert _same(_sorted(ours), _flwr_parts(ref, {"y": y}))


@pytest.mark.parametrize("power, name", [(1.0, "LinearPartitioner"), (2.0, "SquarePartitioner")])
def test_quantity_power_equals_flwr_on_the_shuffled_set(flwr, power, name):
    y = _labels(997, 4)
    ref = getattr(flwr, name)(num_partitions=6)
    ours = make_partition(y, 6, PartitionConfig("quantity", size_skew="power", power=power), 11)
    assert _same(_sorted(ours), _flwr_parts(ref, {"y": y}, shuffle_seed=11))
