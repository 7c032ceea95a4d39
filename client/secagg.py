"""Site side of the secure sum: the reply SecAgg+ masks, and the ChaCha20 mask-PRG patch.

What a collect message carries beside its config is read here too: :func:`sent_reference`
decodes the one float64 noisy vector a release-first select request names (numpy's format,
never a pickle), and :func:`carried_arrays` lets the handler refuse arrays it did not ask for.

The site's ``train`` handler runs under Flower's ``secaggplus_mod``
(``@app.train(mods=[secaggplus_mod])``). At the collect stage the mod calls the handler,
which returns :func:`secure_sum_reply`; the mod then quantises every coordinate to the
grid of ``[-c, c]`` (clipping silently beyond), adds the masks and sends only the masked
integers. Because a silent clip would bias the sum (and break the DP sensitivity bound),
:func:`secure_sum_reply` refuses any coordinate beyond ``±c``. ``c`` is the coordinator's
``clipping_range`` from the SecAgg+ setup stage; :func:`secaggplus_clipping_range` reads it
from the mod's state in the handler's ``Context``.

Exceptions raised here become an error reply whose text reaches the coordinator, so their
messages name the array and the bound but never a private value.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from flwr.common import (
    Code,
    FitRes,
    NDArrayInt,
    Status,
    ndarrays_to_parameters,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE, Key, Stage
from flwr.compat.common.recorddict_compat import fitres_to_recorddict

from dpmtv_common.aliases import Float64Array
from dpmtv_common.crypto import mask_prg, shamir
from dpmtv_common.errors import ConfigError
from protocol import PlanMismatchError

__all__ = [
    "FITINS_CONFIG",
    "FITINS_PARAMETERS",
    "SecAggRanges",
    "carried_arrays",
    "install_secure_mask_prg",
    "mask_prg_in_use",
    "secaggplus_clipping_range",
    "secaggplus_ranges",
    "secure_sum_reply",
    "sent_reference",
]

# The package ``flwr.client.mod.secure_aggregation`` rebinds the name ``secaggplus_mod`` to
# the mod *function*, so the module is fetched from the import system, not by attribute.
_MOD_MODULE = "flwr.client.mod.secure_aggregation.secaggplus_mod"
# The global that the mod module imported from secaggplus_utils and calls at collect.
_PATCHED_NAME = "pseudo_rand_gen"
_SHAMIR_NAME = "create_shares"  # imported there from flwr...crypto.shamir; called at share keys
# Flower's legacy FitIns record keys, as its SecAgg+ workflow sends them at collect.
FITINS_CONFIG = "fitins.config"
FITINS_PARAMETERS = "fitins.parameters"


def secure_sum_reply(
    msg: Message, arrays: Sequence[npt.ArrayLike], *, clipping_range: float
) -> Message:
    """Build the reply ``secaggplus_mod`` masks: the arrays, weight 1, nothing in plaintext.

    The layout is Flower's legacy FitRes (``fitres.parameters``, ``fitres.num_examples`` = 1,
    empty ``fitres.metrics``, status OK); the mod replaces the parameters by masked integers
    and forwards the rest in plaintext, hence weight 1 and no metrics.

    Args:
        msg: The collect-stage message the handler received.
        arrays: The site's contributions (e.g. its sum of clipped chunk vectors); each is sent
            as float64 (float32 would cap precision at one ulp of 2c) and must have ndim >= 1
            (Flower mis-handles 0-d arrays).
        clipping_range: The per-coordinate bound c of the sum, normally
            ``secaggplus_clipping_range(context)``.

    Raises:
        ConfigError: If a coordinate is beyond ``±clipping_range`` or not finite, an array is
            0-d or empty input, or the coordinator announced another mask PRG than this site
            runs (the masks would not cancel).
    """
    _check_mask_prg(msg)
    bound = _checked_bound(clipping_range)
    checked = [_checked_array(index, array, bound) for index, array in enumerate(arrays)]
    if not checked:
        raise ConfigError("arrays must hold at least one array, got none.")
    fitres = FitRes(
        status=Status(code=Code.OK, message="Success"),
        parameters=ndarrays_to_parameters(checked),
        num_examples=1,  # weight 1 with max_weight 1: the coordinator gets a sum, unscaled
        metrics={},  # plaintext on the wire: keep empty
    )
    return Message(fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


def secaggplus_clipping_range(context: Context) -> float:
    """Return the clipping range c the coordinator set up for the current secure sum.

    ``secaggplus_mod`` stores the setup-stage parameters in ``context.state`` (config record
    ``"secaggplus_state"``, key ``"clipping_range"``) and saves its state only after the
    handler returns, so during the collect stage the stored stage is still ``share_keys``.

    Raises:
        ConfigError: If not called from a handler running under ``secaggplus_mod``'s collect
            stage.
    """
    state = context.state.config_records.get(RECORD_KEY_STATE)
    stage = state.get("current_stage") if state is not None else None
    if state is None or stage != Stage.SHARE_KEYS:
        raise ConfigError(
            f"secaggplus_clipping_range must be called by a handler under secaggplus_mod at "
            f"the collect stage, got stored stage {stage!r}."
        )
    return _checked_bound(state.get(Key.CLIPPING_RANGE))


@dataclass(frozen=True)
class SecAggRanges:
    """The SecAgg+ grid the coordinator set up: clipping range c, quantization Q, modulus M."""

    clipping_range: float
    quantization_range: int
    modulus_range: int


def secaggplus_ranges(context: Context) -> SecAggRanges:
    """The grid of the current secure sum, read like :func:`secaggplus_clipping_range`.

    Raises:
        ConfigError: If not called at the collect stage, or a range is not an int.
    """
    clipping = secaggplus_clipping_range(context)
    state = context.state.config_records[RECORD_KEY_STATE]
    quantization, modulus = state.get(Key.TARGET_RANGE), state.get(Key.MOD_RANGE)
    if not (isinstance(quantization, int) and isinstance(modulus, int)):
        raise ConfigError(f"SecAgg+ ranges must be ints, got {quantization!r} and {modulus!r}.")
    return SecAggRanges(clipping, quantization, modulus)


def install_secure_mask_prg() -> None:
    """Make this process's ``secaggplus_mod`` expand masks with ChaCha20 (idempotent).

    Patches the name ``pseudo_rand_gen`` in
    ``flwr.client.mod.secure_aggregation.secaggplus_mod`` (imported there from
    ``flwr.common.secure_aggregation.secaggplus_utils``; the collect stage calls it for the
    site's private mask and one pairwise mask per neighbour). ``secagg_mod`` delegates to
    this module and is covered too. The coordinator must call
    ``server.secagg.install_secure_mask_prg()``, or the masks do not cancel;
    :func:`secure_sum_reply` refuses a mismatch announced by the coordinator.

    The share-keys stage's ``create_shares`` is replaced too, by
    ``dpmtv_common.crypto.shamir.create_shares``: the same shares bit for bit from the same
    random bytes (a coordinator running Flower's own reconstruction interoperates), tens of
    times faster.
    """
    names = vars(importlib.import_module(_MOD_MODULE))
    names[_PATCHED_NAME] = _chacha20_pseudo_rand_gen
    names[_SHAMIR_NAME] = shamir.create_shares


def mask_prg_in_use() -> str:
    """Return the name of the mask expansion this process's ``secaggplus_mod`` runs."""
    current = vars(importlib.import_module(_MOD_MODULE))[_PATCHED_NAME]
    installed = current is _chacha20_pseudo_rand_gen
    return mask_prg.MASK_PRG_NAME if installed else mask_prg.FLOWER_PRG_NAME


def _chacha20_pseudo_rand_gen(
    seed: bytes, num_range: int, dimensions_list: list[tuple[int, ...]]
) -> list[NDArrayInt]:
    """Stand in for Flower's ``pseudo_rand_gen``, with its signature."""
    return mask_prg.expand_mask(seed, num_range, dimensions_list)


def _check_mask_prg(msg: Message) -> None:
    config = msg.content.config_records.get(FITINS_CONFIG, ConfigRecord())
    announced = config.get(mask_prg.MASK_PRG_CONFIG_KEY)
    ours = mask_prg_in_use()
    if announced != ours:
        raise ConfigError(
            f"the coordinator's mask PRG must match this site's {ours!r}, got {announced!r}: "
            f"the masks would not cancel. Both sides must call install_secure_mask_prg()."
        )


def _checked_bound(clipping_range: object) -> float:
    if isinstance(clipping_range, int | float) and not isinstance(clipping_range, bool):
        bound = float(clipping_range)
        if math.isfinite(bound) and bound > 0:
            return bound
    raise ConfigError(f"clipping_range must be a finite number > 0, got {clipping_range!r}.")


def _checked_array(index: int, array: npt.ArrayLike, bound: float) -> Float64Array:
    values = np.asarray(array, dtype=np.float64)
    if values.ndim == 0:
        raise ConfigError(f"arrays[{index}] must have ndim >= 1, got a 0-d array; reshape(1).")
    if not np.isfinite(values).all():
        raise ConfigError(f"arrays[{index}] must be finite, got NaN or infinity.")
    if values.size and np.abs(values).max() > bound:
        raise ConfigError(
            f"arrays[{index}] must lie within ±clipping_range={bound} per coordinate "
            f"(SecAgg+ would clip it silently and bias the sum), got a coordinate beyond it. "
            f"Clip before summing or size the plan's range for the site's chunk count."
        )
    return values


def sent_reference(msg: Message) -> Float64Array:
    """The one float64 array a select request carries beside its config (the noisy vector).

    Raises:
        PlanMismatchError: No array, several, or not float64 (decoded without pickles).
    """
    arrays = carried_arrays(msg)
    if len(arrays) != 1:
        raise PlanMismatchError(
            f"a select request naming reference heads must carry one array, got {len(arrays)}."
        )
    try:
        # numpy's own format, loaded with allow_pickle=False. Flower's legacy encoding has no
        # dtype or shape header, so protocol.arrays_from_record's header check cannot apply.
        values = arrays[0].numpy()
    except (TypeError, ValueError, EOFError, OSError) as exc:
        raise PlanMismatchError(f"the reference array must be a numpy array: {exc}") from exc
    if values.dtype != np.float64:
        raise PlanMismatchError(f"the reference array must be float64, got {values.dtype}.")
    return values


def carried_arrays(msg: Message) -> list[Array]:
    """The arrays a collect message carries beside its config (the FitIns parameters)."""
    # Flower encodes "no parameters" as one empty placeholder array; that is not an array.
    record = msg.content.array_records.get(FITINS_PARAMETERS, ArrayRecord())
    return [array for array in record.values() if array.data]
