"""Placements are immutable values: equal by value, hashable, picklable, printed as their code."""

from __future__ import annotations

import copy
import pickle

import pytest

from hyper_parallel.dtensor import Partial, Placement, Replicate, Shard

ALL = [Shard(0), Shard(1), Shard(-1), Replicate(), Partial(), Partial("avg"), Partial("max")]


def test_placements_equal_by_value_and_hash_alike() -> None:
    assert Shard(1) == Shard(1) and hash(Shard(1)) == hash(Shard(1))
    assert Replicate() == Replicate() and hash(Replicate()) == hash(Replicate())
    assert Partial("min") == Partial("min") and hash(Partial("min")) == hash(Partial("min"))
    assert Partial() == Partial("sum")
    # distinct values are distinct, across and within kinds
    for i, a in enumerate(ALL):
        for j, b in enumerate(ALL):
            assert (a == b) == (i == j), (a, b)
    assert len(set(ALL)) == len(ALL)
    assert {Shard(0): "row"}[Shard(0)] == "row"


def test_placements_are_immutable() -> None:
    shard = Shard(0)
    with pytest.raises(AttributeError, match="Shard is immutable; cannot set 'dim'"):
        shard.dim = 1  # type: ignore[misc]
    with pytest.raises(AttributeError, match="Partial is immutable"):
        Partial().reduce_op = "max"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="Shard is immutable; cannot delete 'dim'"):
        del shard.dim
    with pytest.raises(AttributeError):
        Replicate().extra = 1  # type: ignore[attr-defined]
    assert shard == Shard(0)


def test_placement_repr_reads_like_the_code_that_made_it() -> None:
    assert repr(Shard(1)) == "Shard(dim=1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(reduce_op='sum')"
    assert repr(Partial("avg")) == "Partial(reduce_op='avg')"
    namespace = {"Shard": Shard, "Replicate": Replicate, "Partial": Partial}
    for p in ALL:
        assert eval(repr(p), namespace) == p


def test_placements_survive_pickle_and_copy() -> None:
    for p in ALL:
        assert pickle.loads(pickle.dumps(p)) == p
        assert copy.deepcopy(p) == p and copy.copy(p) == p


def test_placement_predicates() -> None:
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert not Shard(0).is_replicate() and not Shard(0).is_partial()
    assert Replicate().is_replicate() and not Replicate().is_shard()
    assert Partial("max").is_partial() and not Partial().is_replicate()
    assert all(isinstance(p, Placement) for p in ALL)


def test_shard_rejects_a_non_int_dim() -> None:
    with pytest.raises(
        TypeError, match=r"Shard\(dim\): expected an int tensor dimension, found 1.0"
    ):
        Shard(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="found True"):
        Shard(True)


def test_partial_rejects_an_unknown_reduce_op() -> None:
    with pytest.raises(
        ValueError,
        match=r"expected one of \('sum', 'avg', 'product', 'max', 'min'\) \(or 'prod'\), found 'mean'",
    ):
        Partial("mean")  # type: ignore[arg-type]


def test_partial_prod_is_torchs_other_spelling_of_product() -> None:
    assert Partial("prod") == Partial("product")
    assert Partial("prod").reduce_op == "product"


def test_one_object_per_placement_value() -> None:
    # equality and hashing are identity's (the dispatcher's keys rely on it), so equal
    # values must be one object, however they were made
    assert Shard(1) is Shard(1) and Replicate() is Replicate() and Partial() is Partial("sum")
    assert Partial("prod") is Partial("product")
    assert Shard(-1) is not Shard(1)
    for p in ALL:
        assert pickle.loads(pickle.dumps(p)) is p and copy.deepcopy(p) is p
    # an interned Shard(1) does not let a bool through: True == 1, but Shard(True) is an error
    with pytest.raises(TypeError, match="expected an int tensor dimension"):
        Shard(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Partial\\(reduce_op\\)"):
        Partial("mean")  # type: ignore[arg-type]
