"""The ledger's byte counts without serialising: ``encoded_size(p) == len(encode(p))`` exactly.

The sequential backend hands payloads over in process and counts them with
:func:`fedgalore.protocol.payload.encoded_size`; these tests pin that number to the real writer
over every entry kind, dtype, shape and header content that can change it.
"""
from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import save as st_save

from fedgalore.protocol.payload import (
    Dense,
    Factored,
    GaLoreUpdate,
    Ledger,
    LowRank,
    MomentView,
    Payload,
    SeededLowRank,
    decode,
    encode,
    encoded_size,
    safetensors_size,
    transfer,
)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def _t(rng: random.Random, shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    x = torch.randn(*shape, generator=g) if shape else torch.randn((), generator=g)
    return x.to(dtype)


def _random_payload(rng: random.Random) -> Payload:
    entries = {}
    for i in range(rng.randrange(0, 9)):
        m, n, r = rng.randrange(1, 40), rng.randrange(1, 40), rng.randrange(1, 6)
        kind = rng.randrange(7)
        name = rng.choice(["w", "layer.0.attn.q_proj.weight", "h/ead", 'q"uote', "back\\slash", "é-ü", "tab\tname"]) + str(i)
        dt = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        if kind == 0:
            entries[name] = Dense(_t(rng, [m, n], rng.choice(DTYPES)))
        elif kind == 1:
            entries[name] = LowRank(_t(rng, [m, r], dt), _t(rng, [r, n], dt))
        elif kind == 2:
            entries[name] = SeededLowRank(_t(rng, [m, r]), rng.randrange(1 << 62), "right", (m, n))
        elif kind == 3:
            shared = _t(rng, [r, n])  # a tensor two terms share: stored (and counted) once
            terms = (LowRank(_t(rng, [m, r]), shared), LowRank(_t(rng, [m, r]), shared),
                     SeededLowRank(_t(rng, [r, n]), rng.randrange(1000), "left", (m, n)))
            entries[name] = GaLoreUpdate(rng.choice([0.0, -1e-3]), terms, (m, n))
        elif kind == 4:
            entries[name] = MomentView(_t(rng, [m, r]).abs(), "right", (m, n), basis=_t(rng, [r, n]),
                                       weight=_t(rng, [r]) if rng.random() < 0.5 else None)
        elif kind == 5:
            entries[name] = MomentView(_t(rng, [r, n]).abs(), "left", (m, n), seed=rng.randrange(1 << 40))
        else:
            entries[name] = Factored(_t(rng, [m, 2]), _t(rng, [2, 3]), _t(rng, [n, 3]))
    if rng.random() < 0.3 and entries:  # a scalar and an empty tensor
        entries["scalar"] = Dense(torch.tensor(3.5))
        entries["empty"] = Dense(torch.zeros(0, 4))
    meta = {"round": rng.randrange(10**9), "client": rng.randrange(100), "loss": rng.random(),
            "note": rng.choice(["", "naïve \"quoted\" \\ text\n", "x" * rng.randrange(50)]),
            "downlink": {"from": rng.randrange(5), "to": rng.randrange(5, 9)}, "ok": rng.random() < 0.5, "none": None}
    return Payload(entries, meta)


def test_encoded_size_equals_the_written_length_for_random_payloads():
    rng = random.Random(0)
    for _ in range(300):
        p = _random_payload(rng)
        n = len(encode(p))
        assert encoded_size(p) == n
        assert p.nbytes() == n
    # offsets cross digit boundaries (9 → 10, 99 → 100 ... bytes): the written order decides them
    p = Payload({f"t{i}": Dense(torch.zeros(k)) for i, k in enumerate([1, 2, 3, 25, 250, 2500, 25000])}, {})
    assert encoded_size(p) == len(encode(p))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64])
def test_safetensors_size_per_dtype_and_mixed_order(dtype):
    g = torch.Generator().manual_seed(1)
    tensors = {"b": torch.randn(7, 3, generator=g).to(dtype), "a": torch.randn(5, generator=g).to(torch.bfloat16),
               "c": torch.zeros(11, dtype=torch.int64), "z": torch.randn(2, 2, generator=g).to(dtype)}
    assert safetensors_size(tensors, {"fedgalore": "{}"}) == len(st_save(tensors, metadata={"fedgalore": "{}"}))
    assert safetensors_size(tensors) == len(st_save(tensors))


def test_noncontiguous_and_shared_tensors_are_sized_as_written():
    w = torch.randn(6, 9)
    p = Payload({"a": Dense(w.T), "b": LowRank(w[:, :2], w[:2, :]), "c": Dense(w)}, {"k": 1})
    assert encoded_size(p) == len(encode(p))


@pytest.mark.isa
def test_a_message_size_does_not_depend_on_its_floats():
    """Floats in a header have a fixed width (issue 29: a loss's last digits, which the CPU's
    kernels decide, changed the ledger's byte totals from one machine to another); they read
    back as the same doubles, and the header is json.dumps's otherwise."""
    import json
    import math

    from fedgalore.protocol.payload import FLOAT_WIDTH, dump_header_json

    w = torch.ones(2, 3)
    sizes, values = set(), [0.1, 1.2177465657393138, -3.3e-120, 1e300, 0.0, -0.0, 2.5, math.nan, math.inf, -math.inf]
    for x in values:
        p = Payload({"g": GaLoreUpdate(x, (LowRank(w.T, w),), (3, 3))}, {"loss": x, "steps": 3, "hist": [x, 1.0]})
        blob = encode(p)
        sizes |= {len(blob), encoded_size(p)}
        back = decode(blob)
        for y in (back.meta["loss"], back.meta["hist"][0], back["g"].decay):
            assert (math.isnan(x) and math.isnan(y)) or (y == x and math.copysign(1, y) == math.copysign(1, x))
    assert len(sizes) == 1
    assert all(len(dump_header_json(x)) == FLOAT_WIDTH for x in values + [5e-324, -1.7976931348623157e308])
    plain = {"b": [1, "x\u00e9\"\n", None, True, {}], "a": {"2": False, "10": []}, "c": ()}
    assert dump_header_json(plain) == json.dumps(plain, sort_keys=True)


def test_ledger_counts_the_computed_size_exactly_like_the_blob():
    rng = random.Random(5)
    p = _random_payload(rng)
    by_blob, by_size = Ledger(), Ledger()
    by_blob.record(1, 0, "up", p, encode(p))
    by_size.record(1, 0, "up", p)  # no blob: computed
    by_size.record(1, 1, "up", p, len(encode(p)))  # a length
    assert by_blob.records[0] == by_size.records[0]
    assert by_size.records[1]["bytes"] == by_blob.records[0]["bytes"]


def test_transfer_is_decode_of_encode_on_private_copies():
    rng = random.Random(11)
    for _ in range(50):
        p = _random_payload(rng)
        got, want = transfer(p), decode(encode(p))
        assert got.meta == want.meta and list(got.entries) == list(want.entries)
        assert repr(_structure(got)) == repr(_structure(want))
        for a, b in zip(_leaves(got), _leaves(want)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
            assert torch.equal(a, b)
    w = torch.ones(3, 3)
    q = transfer(Payload({"w": Dense(w)}))
    q.entries["w"].tensor.mul_(5)  # the receiver's copy is its own
    assert torch.equal(w, torch.ones(3, 3))


def _leaves(p: Payload) -> list[torch.Tensor]:
    from fedgalore.protocol.payload import flatten_entries

    return list(flatten_entries(p.entries, materialize=False)[1].values())


def _structure(p: Payload):
    from fedgalore.protocol.payload import flatten_entries

    return flatten_entries(p.entries, materialize=False)[0]


@pytest.mark.parametrize("meta", [None, {"fedgalore": '{"x": "naïve \\"q\\" \\\\"}'}, {"fedgalore": "{}", "other": "1"}])
def test_streamed_writer_is_byte_identical_to_safetensors_save(tmp_path, meta):
    import io

    from fedgalore.protocol.payload import write_safetensors

    g = torch.Generator().manual_seed(3)
    tensors = {"p/w": torch.randn(33, 17, generator=g), "p/h": torch.randn(9, generator=g).to(torch.bfloat16),
               "x/step": torch.tensor(7, dtype=torch.int64), "x/s": torch.tensor(2.5), "m/empty": torch.zeros(0, 3),
               "m/mask": torch.rand(5, generator=g) > 0.5, "p/t": torch.randn(8, 6, generator=g).T}  # non-contiguous
    buf = io.BytesIO()
    n = write_safetensors(buf, tensors, meta, chunk=64)  # small chunks: every tensor split
    want = st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
    assert n == len(buf.getvalue()) == len(want)
    if meta is None or len(meta) == 1:  # safetensors writes a metadata map in hash order: bytes equal for one key
        assert buf.getvalue() == want
    from safetensors import safe_open
    from safetensors.torch import load

    got = load(buf.getvalue())
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    path = tmp_path / "x.safetensors"
    path.write_bytes(buf.getvalue())
    with safe_open(str(path), "pt") as fh:
        assert fh.metadata() == meta
