"""Layer names in error messages: from the parents a layer was placed into, from wrapping, never from gc."""

from __future__ import annotations

import copy

import torch
from torch import nn

import syncbn
from syncbn import _checks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.bn1 = syncbn.SyncBatchNorm2d(3)


def make_net() -> nn.Module:
    return nn.Sequential(nn.Sequential(Block()), nn.ModuleDict({"head": syncbn.SyncBatchNorm1d(5)}))


def test_a_built_model_names_its_layers_without_name_layers() -> None:
    net = make_net()
    assert _checks.layer_name(net[0][0].bn1) == "'0.0.bn1' SyncBatchNorm2d(3)"
    assert _checks.layer_name(net[1]["head"]) == "'1.head' SyncBatchNorm1d(5)"


def test_names_read_as_in_the_bare_model_inside_a_wrapper() -> None:
    net = make_net()
    wrapped = nn.DataParallel(net)
    assert _checks.layer_name(wrapped.module[0][0].bn1).startswith("'0.0.bn1'")


def test_name_layers_reads_through_torch_compile() -> None:
    # Once '_orig_mod.0.0.bn1': compile's wrapper attribute, where error messages said '0.0.bn1'.
    net = make_net()
    outer = nn.Sequential(torch.compile(nn.Sequential(syncbn.SyncBatchNorm1d(2))))
    assert syncbn.name_layers(torch.compile(net)) == 2 and syncbn.name_layers(outer) == 1
    assert _checks.state_of(net[0][0].bn1).name == "0.0.bn1" == _checks.qualified_name(net[0][0].bn1)
    assert _checks.state_of(outer[0]._orig_mod[0]).name == "0.0"
    single = syncbn.SyncBatchNorm1d(2)
    syncbn.name_layers(torch.compile(single))
    assert _checks.state_of(single).name == "SyncBatchNorm1d"  # as the bare layer is named


def test_a_moved_layer_is_named_where_it_is_now() -> None:
    bn = syncbn.SyncBatchNorm1d(2)
    old, new = nn.Sequential(bn), nn.ModuleDict()
    new["norm"] = bn
    old[0] = nn.Identity()  # no longer holds the layer
    assert _checks.layer_name(bn).startswith("'norm'")


def test_a_layer_held_nowhere_is_named_by_its_construction_index() -> None:
    bn = syncbn.SyncBatchNorm1d(2)
    text = _checks.layer_name(bn)
    assert text.startswith(f"#{bn._syncbn_state.index} SyncBatchNorm1d(2)") and "name_layers" in text


def test_a_copied_model_is_named_when_wrapped() -> None:
    clone = copy.deepcopy(make_net())  # copies carry no parent links
    assert clone[0][0].bn1._syncbn_state.name is None
    nn.DataParallel(clone)
    assert clone[0][0].bn1._syncbn_state.name == "0.0.bn1"
    assert clone[1]["head"]._syncbn_state.name == "1.head"


def test_wrapping_keeps_the_names_given_by_name_layers() -> None:
    net = make_net()
    syncbn.name_layers(net, prefix="student")
    nn.DataParallel(net)
    assert net[0][0].bn1._syncbn_state.name == "student.0.0.bn1"


def test_replicas_record_no_parents() -> None:
    net = make_net()
    replicas = syncbn.parallel.replicate(net, 2)
    assert _checks.qualified_name(replicas[1][0][0].bn1) is None
    assert _checks.qualified_name(net[0][0].bn1) == "0.0.bn1"
    torch.testing.assert_close(replicas[1][0][0].bn1.weight, net[0][0].bn1.weight)
