"""Byzantine-robust aggregation (fedgalore.federated.robust): the factored Gram matrix against the
dense computation, Krum / Multi-Krum, median and trimmed mean against Flower's own functions."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from fedgalore.federated import robust
from fedgalore.federated.robust import (
    Term,
    coordinate_median,
    dense_term,
    factored_term,
    gram,
    inner,
    krum_scores,
    krum_select,
    norm_filter,
    sq_distances,
    trimmed_mean,
    update_terms,
)
from fedgalore.protocol.payload import Dense, GaLoreUpdate, LowRank, MomentView, SeededLowRank


flwr_agg = pytest.importorskip("flwr.server.strategy.aggregate")

SHAPES = {"q": (6, 5), "v": (4, 7), "bias": (5,)}


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(shape, gen, scale=1.0):
    return scale * torch.randn(shape, generator=gen, dtype=torch.float32)


def _random_entry(kind: str, shape, gen, seed: int):
    if kind == "dense":
        return Dense(_rand(shape, gen))
    m, n = shape
    r = 2
    if kind == "lowrank":
        return LowRank(_rand((m, r), gen), _rand((r, n), gen))
    if kind == "seeded_right":
        return SeededLowRank(_rand((m, r), gen), seed, "right", shape)
    if kind == "seeded_left":
        return SeededLowRank(_rand((r, n), gen), seed, "left", shape)
    if kind == "galore":
        terms = (
            LowRank(_rand((m, 3), gen), _rand((3, n), gen)),
            SeededLowRank(_rand((m, r), gen), seed + 1, "right", shape),
            SeededLowRank(_rand((r, n), gen), seed + 2, "left", shape),
        )
        return GaLoreUpdate(-0.01 * (1 + seed % 3), terms, shape)
    raise AssertionError(kind)


def _dense_reference(entry, base) -> torch.Tensor:
    """The entry's update materialised in float64 from its own factors (independent of Term)."""
    if isinstance(entry, Dense):
        return entry.tensor.double()
    if isinstance(entry, (LowRank, SeededLowRank)):
        left, right = entry.factors()
        return left.double() @ right.double()
    out = torch.zeros(entry.shape, dtype=torch.float64)
    for t in entry.terms:
        left, right = t.factors()
        out += left.double() @ right.double()
    return out + entry.decay * base.double()


KINDS = ["dense", "lowrank", "seeded_right", "seeded_left", "galore"]


def _mixed_clients(k: int, seed: int):
    gen = _g(seed)
    bases = {key: _rand(shape, gen) for key, shape in SHAPES.items()}
    updates, flats = [], []
    for i in range(k):
        terms, dense = {}, {}
        for j, (key, shape) in enumerate(SHAPES.items()):
            if key == "q" and i == 1:
                continue  # client 1 has no update for "q": counts as zero
            kind = "dense" if len(shape) == 1 else KINDS[(i + j) % len(KINDS)]
            entry = _random_entry(kind, shape, gen, seed=100 * i + j)
            terms[key] = update_terms(entry, base=bases[key], key=key)
            dense[key] = _dense_reference(entry, bases[key])
        updates.append(terms)
        flats.append(torch.cat([dense.get(key, torch.zeros(SHAPES[key], dtype=torch.float64)).reshape(-1)
                                for key in SHAPES]))
    return updates, torch.stack(flats)


def test_gram_matches_dense_computation():
    updates, flat = _mixed_clients(k=6, seed=0)
    g = gram(updates)
    ref = flat @ flat.T
    assert g.dtype == torch.float64 and g.shape == (6, 6)
    torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-10 * ref.abs().max().item())
    torch.testing.assert_close(g, g.T, rtol=1e-14, atol=0.0)
    eig = torch.linalg.eigvalsh(g)
    assert eig.min().item() >= -1e-9 * eig.abs().max().item()
    # distances agree with the dense ones too
    d_ref = torch.cdist(flat, flat) ** 2
    torch.testing.assert_close(sq_distances(g), d_ref, rtol=1e-9, atol=1e-9 * d_ref.max().item())
    assert torch.all(torch.diagonal(sq_distances(g)) == 0)


@pytest.mark.parametrize("ka,kb", [(a, b) for a in KINDS for b in KINDS])
def test_inner_every_pair_of_entry_kinds(ka, kb):
    gen = _g(1)
    shape = (5, 4)
    base = _rand(shape, gen)
    ea = _random_entry(ka, shape, gen, seed=3)
    eb = _random_entry(kb, shape, gen, seed=7)
    got = inner(update_terms(ea, base), update_terms(eb, base))
    want = (_dense_reference(ea, base) * _dense_reference(eb, base)).sum().item()
    assert got == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_inner_uses_coefficients_and_checks_shapes():
    gen = _g(2)
    a, l, r = _rand((3, 4), gen), _rand((3, 2), gen), _rand((2, 4), gen)
    want = (-2.5 * a.double() * 0.5 * (l.double() @ r.double())).sum().item()
    got = inner([dense_term(a, -2.5)], [factored_term(l, r, coef=0.5)])
    assert got == pytest.approx(want, rel=1e-10)
    with pytest.raises(ValueError, match="shape"):
        inner([dense_term(a)], [factored_term(r.T, l.T)])
    with pytest.raises(ValueError):
        factored_term(l, l)


def test_update_terms_errors():
    gen = _g(3)
    upd = _random_entry("galore", (4, 3), gen, seed=0)
    with pytest.raises(ValueError, match="'layer.q'.*W0"):
        update_terms(upd, None, key="layer.q")
    no_decay = GaLoreUpdate(0.0, upd.terms, upd.shape)
    assert len(update_terms(no_decay)) == 3
    with pytest.raises(TypeError, match="MomentView"):
        update_terms(MomentView(_rand((4, 2), gen), "right", (4, 3), basis=_rand((2, 3), gen)))


# ---------------------------------------------------------------- Krum against Flower


def _flower_clients(k: int, n_bad: int, seed: int, dtype=np.float64):
    rng = np.random.default_rng(seed)
    clients = []
    for i in range(k):
        shift = 25.0 if i >= k - n_bad else 0.0
        clients.append([(rng.normal(size=(3, 4)) + shift).astype(dtype),
                        (rng.normal(size=(5,)) - shift).astype(dtype)])
    order = rng.permutation(k)  # the far-away clients are not simply the last ones
    return [clients[i] for i in order]


def _as_updates(clients):
    return [{f"l{j}": [dense_term(torch.from_numpy(w))] for j, w in enumerate(c)} for c in clients]


def _flower_scores(dist: np.ndarray, num_malicious: int) -> np.ndarray:
    # the score lines of flwr aggregate_krum (aggregate.py 110-123), on a given matrix
    num_closest = max(1, len(dist) - num_malicious - 2)
    return np.array([np.sum(row[np.argsort(row)[1: num_closest + 1]]) for row in dist])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_krum_matches_flower(seed):
    k, f = 7, 2
    clients = _flower_clients(k, n_bad=2, seed=seed)
    d = sq_distances(gram(_as_updates(clients)))
    d_flwr = flwr_agg._compute_distances(clients)
    np.testing.assert_allclose(d.numpy(), d_flwr, rtol=1e-9, atol=1e-9 * d_flwr.max())
    np.testing.assert_allclose(krum_scores(d, f).numpy(), _flower_scores(d_flwr, f), rtol=1e-9)

    results = [(c, 10) for c in clients]
    (chosen,) = krum_select(d, f, 1)
    for to_keep in (0, 1):  # Flower's Krum (0) and one-client Multi-Krum (1)
        picked = flwr_agg.aggregate_krum(results, num_malicious=f, to_keep=to_keep)
        for ours, theirs in zip(clients[chosen], picked):
            np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)

    sel = krum_select(d, f, 3)
    assert len(sel) == 3 and sel == sorted(sel) and chosen in sel
    multi = flwr_agg.aggregate_krum(results, num_malicious=f, to_keep=3)
    for j, theirs in enumerate(multi):
        ours = np.mean([clients[i][j] for i in sel], axis=0)
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    far = [i for i, c in enumerate(clients) if c[0].mean() > 10]
    assert len(far) == 2 and not set(far) & set(sel)


def test_krum_neighbour_convention_with_duplicate_clients():
    # two identical clients: Flower drops the first sorted (zero) entry of each row; the score
    # still sums K - f - 2 distances to *others*, one of them the zero to the twin
    clients = _flower_clients(6, n_bad=1, seed=4)
    clients[3] = [w.copy() for w in clients[1]]
    d = sq_distances(gram(_as_updates(clients)))
    d_flwr = flwr_agg._compute_distances(clients)
    np.testing.assert_allclose(krum_scores(d, 1).numpy(), _flower_scores(d_flwr, 1),
                               rtol=1e-9, atol=1e-9 * d_flwr.max())
    row = d[1].clone()
    row[1] = float("inf")
    assert krum_scores(d, 1)[1].item() == pytest.approx(torch.sort(row).values[:3].sum().item(),
                                                        rel=1e-12)


def test_krum_select_ties_broken_by_lower_index():
    # four points on a square: every score equal -> the lowest indices
    d = torch.tensor([[0.0, 1, 2, 1], [1, 0, 1, 2], [2, 1, 0, 1], [1, 2, 1, 0]], dtype=torch.float64)
    assert krum_select(d, 0, 1) == [0]
    assert krum_select(d, 0, 2) == [0, 1]
    with pytest.raises(ValueError, match="to_keep"):
        krum_select(d, 0, 5)


def test_krum_too_few_clients_names_num_malicious():
    d = torch.zeros((4, 4), dtype=torch.float64)
    with pytest.raises(ValueError, match="num_malicious") as err:
        krum_scores(d, 2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="num_malicious"):
        krum_select(d, 2, 1)
    assert krum_scores(d, 1).shape == (4,)


# ---------------------------------------------------------------- attacks and invariances


def _factored_clients(k: int, seed: int, mean_scale: float = 3.0):
    """Honest clients: a common low-rank update plus small low-rank noise, as factored terms."""
    gen = _g(seed)
    m, n, r = 8, 6, 2
    lm, rm = _rand((m, r), gen, mean_scale), _rand((r, n), gen)
    out = []
    for _ in range(k):
        out.append({
            "w": [factored_term(lm, rm), factored_term(_rand((m, r), gen, 0.3), _rand((r, n), gen))],
            "b": [dense_term(_rand((n,), gen, 0.1) + 1.0)],
        })
    return out


def _scaled(update, c):
    return {key: [Term(t.dense, c * t.coef, t.left, t.right) for t in terms]
            for key, terms in update.items()}


@pytest.mark.parametrize("attack", ["scale50", "signflip"])
@pytest.mark.parametrize("seed", range(4))
def test_krum_never_selects_attacker(attack, seed):
    k, f = 6, 1
    ups = _factored_clients(k, seed)
    bad = seed % k
    ups[bad] = _scaled(ups[bad], 50.0 if attack == "scale50" else -1.0)
    d = sq_distances(gram(ups))
    assert bad not in krum_select(d, f, 1)
    assert bad not in krum_select(d, f, k - f)


def test_norm_filter_drops_scaled_client():
    ups = _factored_clients(6, seed=5)
    ups[2] = _scaled(ups[2], 50.0)
    norms = torch.sqrt(torch.diagonal(gram(ups))).tolist()
    assert norm_filter(norms, 3.0) == [0, 1, 3, 4, 5]
    assert norm_filter(norms, 1e6) == list(range(6))
    # the bound is factor * np.median (mean of the middle two for an even count)
    assert norm_filter([1.0, 2.0, 3.0, 10.0], 1.0) == [0, 1]
    assert norm_filter([1.0, 2.0, 3.0, 10.0], 1.2) == [0, 1, 2]
    assert norm_filter([], 2.0) == []
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="factor"):
            norm_filter(norms, bad)


def test_scores_invariant_under_sign_flip_of_all_updates():
    ups = _factored_clients(6, seed=6, mean_scale=1.0)
    s = krum_scores(sq_distances(gram(ups)), 1)
    s_neg = krum_scores(sq_distances(gram([_scaled(u, -1.0) for u in ups])), 1)
    torch.testing.assert_close(s_neg, s, rtol=1e-12, atol=1e-12 * s.abs().max().item())


def test_gram_invariant_under_factor_rotation():
    ups = _factored_clients(5, seed=7)
    q, _ = torch.linalg.qr(torch.randn(2, 2, generator=_g(8), dtype=torch.float64))

    def rotate(u):
        return {key: [t if t.is_dense else
                      factored_term(t.left.double() @ q, q.T @ t.right.double(), t.coef)
                      for t in terms] for key, terms in u.items()}

    g = gram(ups)
    torch.testing.assert_close(gram([rotate(u) for u in ups]), g, rtol=1e-10,
                               atol=1e-10 * g.abs().max().item())


# ---------------------------------------------------------------- median and trimmed mean


def _layers(k: int, seed: int, dtype):
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=(4, 3)).astype(dtype), rng.normal(size=(7,)).astype(dtype)]
            for _ in range(k)]


@pytest.mark.parametrize("k", [5, 6, 10])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_median_and_trimmed_mean_match_flower(k, dtype):
    clients = _layers(k, seed=k, dtype=dtype)
    results = [(c, 1 + i) for i, c in enumerate(clients)]  # Flower ignores the example counts
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=1e-6, atol=1e-6)
    for j, theirs in enumerate(flwr_agg.aggregate_median(results)):
        ours = coordinate_median([torch.from_numpy(c[j]) for c in clients])
        assert ours.dtype == torch.from_numpy(clients[0][j]).dtype and ours.shape == theirs.shape
        np.testing.assert_allclose(ours.numpy(), theirs, **tol)
    for beta in (0.2, 0.0, 0.3):
        for j, theirs in enumerate(flwr_agg.aggregate_trimmed_avg(results, beta)):
            ours = trimmed_mean([torch.from_numpy(c[j]) for c in clients], beta)
            assert ours.dtype == torch.from_numpy(clients[0][j]).dtype
            np.testing.assert_allclose(ours.numpy(), theirs, **tol)


def test_median_even_count_is_mean_of_middle_values_and_scipy_trim_mean():
    x = [torch.tensor([1.0, 5.0]), torch.tensor([2.0, -1.0]), torch.tensor([10.0, 0.0]),
         torch.tensor([4.0, 3.0])]
    np.testing.assert_allclose(coordinate_median(x).numpy(), [3.0, 1.5], rtol=1e-12)
    assert torch.median(torch.stack(x), dim=0).values[0].item() == pytest.approx(2.0)  # lower one
    stats = pytest.importorskip("scipy.stats")
    clients = [torch.from_numpy(c[0]) for c in _layers(9, seed=1, dtype=np.float64)]
    arr = np.stack([c.numpy() for c in clients])
    np.testing.assert_allclose(trimmed_mean(clients, 0.25).numpy(), stats.trim_mean(arr, 0.25, axis=0),
                               rtol=1e-12)
    nan = [torch.tensor([1.0, float("nan")]), torch.tensor([2.0, 0.0]), torch.tensor([3.0, 1.0])]
    out = coordinate_median(nan)
    assert out[0].item() == pytest.approx(2.0) and torch.isnan(out[1])


def test_coordinatewise_chunking_and_argument_checks(monkeypatch):
    clients = [torch.from_numpy(c[0]) for c in _layers(6, seed=2, dtype=np.float64)]
    arr = np.stack([c.numpy() for c in clients])
    full_med, full_trim = coordinate_median(clients), trimmed_mean(clients, 0.2)
    monkeypatch.setattr(robust, "_CHUNK_VALUES", 13)  # two coordinates per chunk
    np.testing.assert_allclose(coordinate_median(clients).numpy(), np.median(arr, axis=0), rtol=1e-12)
    torch.testing.assert_close(coordinate_median(clients), full_med, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(trimmed_mean(clients, 0.2), full_trim, rtol=1e-12, atol=1e-12)
    for beta in (0.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="beta"):
            trimmed_mean(clients, beta)
    with pytest.raises(ValueError, match="shape"):
        coordinate_median([clients[0], clients[1].T])
    with pytest.raises(ValueError):
        coordinate_median([])


def test_module_imports_only_downward():
    src = Path(robust.__file__).read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    assert not any(n.startswith(("fedgalore.engine", "fedgalore.methods", "fedgalore.flower"))
                   for n in names)
    assert {n for n in names if n.startswith("fedgalore")} <= {"fedgalore.protocol.payload"}
