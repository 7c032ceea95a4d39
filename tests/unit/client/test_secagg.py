from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common.recorddict_compat import recorddict_to_fitres

from client.secagg import (
    FITINS_CONFIG,
    FITINS_PARAMETERS,
    carried_arrays,
    install_secure_mask_prg,
    mask_prg_in_use,
    secaggplus_clipping_range,
    secure_sum_reply,
    sent_reference,
)
from dpmtv_common.crypto.mask_prg import FLOWER_PRG_NAME, MASK_PRG_CONFIG_KEY, MASK_PRG_NAME
from dpmtv_common.errors import ConfigError
from protocol import PlanMismatchError
from tests.flower_harness import flower_process_state, set_task_identity


@pytest.fixture(autouse=True)
def chacha20_site():
    with flower_process_state():
        set_task_identity()
        install_secure_mask_prg()
        yield


def collect_message(prg: str | None = MASK_PRG_NAME) -> Message:
    config = ConfigRecord({} if prg is None else {MASK_PRG_CONFIG_KEY: prg})
    return Message(RecordDict({FITINS_CONFIG: config}), dst_node_id=7, message_type="train")


def context_with(state: dict[str, Any] | None) -> Context:
    records = RecordDict()
    if state is not None:
        records.config_records["secaggplus_state"] = ConfigRecord(state)
    return Context(run_id=1, node_id=7, node_config={}, state=records, run_config={})


def test_reply_is_the_legacy_fitres_layout_with_weight_one_and_float64():
    # Arrange
    arrays: list[np.ndarray] = [np.array([0.5, -1.0], dtype=np.float32), np.ones((2, 3))]
    # Act
    reply = secure_sum_reply(collect_message(), arrays, clipping_range=1.0)
    # Assert
    fitres = recorddict_to_fitres(reply.content, keep_input=True)
    assert fitres.num_examples == 1
    assert fitres.metrics == {}
    sent = parameters_to_ndarrays(fitres.parameters)
    assert [a.dtype for a in sent] == [np.float64, np.float64]
    np.testing.assert_array_equal(sent[0], [0.5, -1.0])


def test_coordinates_on_the_bound_are_accepted():
    reply = secure_sum_reply(collect_message(), [np.array([2.0, -2.0])], clipping_range=2.0)

    assert reply.has_content()


def test_a_coordinate_beyond_the_bound_is_refused_without_revealing_it():
    with pytest.raises(
        ConfigError, match=r"arrays\[1\] must lie within ±clipping_range=1.0"
    ) as info:
        secure_sum_reply(
            collect_message(), [np.zeros(3), np.array([0.0, 1.2345678])], clipping_range=1.0
        )
    assert "1.234" not in str(info.value)  # the reason travels to the coordinator


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ([np.array(0.5)], r"arrays\[0\] must have ndim >= 1"),
        ([np.array([np.nan])], r"arrays\[0\] must be finite"),
        ([np.array([np.inf])], r"arrays\[0\] must be finite"),
        ([], "arrays must hold at least one array"),
    ],
)
def test_unusable_arrays_are_refused(arrays, message):
    with pytest.raises(ConfigError, match=message):
        secure_sum_reply(collect_message(), arrays, clipping_range=1.0)


@pytest.mark.parametrize("bound", [0.0, -1.0, float("nan"), True])
def test_an_invalid_clipping_range_is_refused(bound):
    with pytest.raises(ConfigError, match="clipping_range must be a finite number > 0"):
        secure_sum_reply(collect_message(), [np.zeros(2)], clipping_range=bound)


@pytest.mark.parametrize("announced", [FLOWER_PRG_NAME, None, "something-else"])
def test_a_coordinator_announcing_another_mask_prg_is_refused(announced):
    with pytest.raises(ConfigError, match="mask PRG must match"):
        secure_sum_reply(collect_message(announced), [np.zeros(2)], clipping_range=1.0)


def test_install_is_idempotent_and_reported():
    install_secure_mask_prg()
    install_secure_mask_prg()

    assert mask_prg_in_use() == MASK_PRG_NAME


def test_clipping_range_is_read_from_the_mods_state_at_the_collect_stage():
    context = context_with({"current_stage": "share_keys", "clipping_range": 4.0})

    assert secaggplus_clipping_range(context) == 4.0


@pytest.mark.parametrize(
    "state", [None, {"current_stage": "unmask", "clipping_range": 4.0}, {"current_stage": "setup"}]
)
def test_clipping_range_outside_the_collect_stage_is_refused(state):
    with pytest.raises(ConfigError, match="secaggplus_clipping_range must be called"):
        secaggplus_clipping_range(context_with(state))


def with_parameters(*arrays: Array) -> Message:
    content = RecordDict(
        {FITINS_PARAMETERS: ArrayRecord({str(i): a for i, a in enumerate(arrays)})}
    )
    return Message(content, dst_node_id=1, message_type="train")


def test_the_sent_reference_is_the_one_float64_array_beside_the_config():
    vector = np.arange(6.0).reshape(1, 2, 3)
    (encoded,) = ndarrays_to_parameters([vector]).tensors
    placeholder = Array(dtype="", shape=(), stype="", data=b"")  # Flower's "no parameters"

    np.testing.assert_array_equal(
        sent_reference(
            with_parameters(Array(dtype="", shape=(), stype="numpy.ndarray", data=encoded))
        ),
        vector,
    )
    assert carried_arrays(with_parameters(placeholder)) == []


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"x", "must be a numpy array"),  # corrupt bytes
        (None, "must be float64"),  # a float32 vector
    ],
)
def test_a_reference_that_is_not_a_float64_numpy_array_is_refused(data, match):
    float32 = ndarrays_to_parameters([np.zeros(3, dtype=np.float32)]).tensors[0]
    array = Array(dtype="", shape=(), stype="numpy.ndarray", data=data or float32)

    with pytest.raises(PlanMismatchError, match=match):
        sent_reference(with_parameters(array))


def test_install_puts_the_vectorised_sharing_in_flowers_share_keys_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Arrange: restore Flower's own names afterwards
    import importlib

    from dpmtv_common.crypto import shamir

    names = vars(importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod"))
    for name in ("create_shares", "pseudo_rand_gen"):
        monkeypatch.setitem(names, name, names[name])

    # Act
    install_secure_mask_prg()

    # Assert
    assert names["create_shares"] is shamir.create_shares
