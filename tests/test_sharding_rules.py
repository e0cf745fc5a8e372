"""Logical axes -> PartitionSpec (no devices needed: a mesh's axis sizes are all the rules
read): each dimension keeps the mesh axes that divide it, in order, and an axis it cannot
take stays free for the next dimension."""

from types import SimpleNamespace

import pytest
from jax.sharding import PartitionSpec as P

from jaxlm.sharding import LOGICAL_RULES, VOCAB_SPLIT_RULES, logical_to_spec


def _mesh(data, fsdp, tensor):
    return SimpleNamespace(shape={"data": data, "fsdp": fsdp, "tensor": tensor})


def test_a_vocabulary_split_keeps_the_axes_that_divide_it():
    table = ("vocab", "embed")
    # divisible by tensor x fsdp: split over both
    assert logical_to_spec(table, VOCAB_SPLIT_RULES, _mesh(1, 4, 2), (32000, 1024)) == P(("tensor", "fsdp"), None)
    # 32004 = 4 * 8001: tensor (2) divides, tensor x fsdp (8) does not -> tensor alone, fsdp left to embed
    assert logical_to_spec(table, VOCAB_SPLIT_RULES, _mesh(1, 4, 2), (32004, 1024)) == P("tensor", "fsdp")
    # the byte vocabulary (259) divides by nothing: the table falls back to the default layout
    assert logical_to_spec(table, VOCAB_SPLIT_RULES, _mesh(1, 8, 1), (259, 1024)) == P(None, "fsdp")
    assert logical_to_spec(table, LOGICAL_RULES, _mesh(1, 8, 1), (259, 1024)) == P(None, "fsdp")


def test_without_a_shape_the_rules_are_taken_as_written():
    assert logical_to_spec(("vocab", "embed"), VOCAB_SPLIT_RULES, _mesh(1, 4, 2)) == P(("tensor", "fsdp"), None)
    assert logical_to_spec(("batch", None), LOGICAL_RULES, _mesh(2, 4, 1)) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed", "mlp"), LOGICAL_RULES, _mesh(1, 1, 2)) == P(None, "tensor")  # size-1 axes drop


def test_more_logical_axes_than_dimensions_is_named():
    with pytest.raises(ValueError, match=r"name 3 dimensions but the array has shape \(4, 4\)"):
        logical_to_spec(("batch", "embed", "mlp"), LOGICAL_RULES, _mesh(1, 2, 1), (4, 4))


def test_mesh_sizes_refuse_bools():
    """make_mesh(data=True) built a mesh with data = 1 (True is an int)."""
    from jaxlm.sharding import make_mesh
    from trainers.config import MeshConfig

    with pytest.raises(ValueError, match="mesh axis data=True is invalid"):
        make_mesh(data=True)
    for kw, match in ((dict(data=True), "trainer.mesh.data=True"), (dict(tensor=0), "trainer.mesh.tensor=0"),
                      (dict(data=-1, fsdp=-1), "at most one axis may be -1")):
        with pytest.raises(ValueError, match=match):
            MeshConfig(**kw)
    assert MeshConfig(data=2, fsdp=-1).fsdp == -1
