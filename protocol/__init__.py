"""The client/server contract of dpmtv: release plan, stages, messages and their wire codec.

Import from here, not from the modules: ``from protocol import ReleasePlan, expect``.
This package imports neither torch nor transformers, nor the ``client``/``server`` apps.
"""

from __future__ import annotations

from protocol.calibration import plan_calibration
from protocol.codec import (
    MESSAGE_RECORD_KEY,
    expect,
    message_from_record,
    message_to_record,
    secure_sum_request_from_config,
    secure_sum_request_to_config,
)
from protocol.distributed import (
    DistributedRelease,
    plan_distributed_calibration,
    plan_distributed_event,
)
from protocol.errors import (
    ErrorCode,
    MessageDecodeError,
    PlanMismatchError,
    ProtocolError,
    RemoteError,
    StageOrderError,
    VersionMismatchError,
)
from protocol.messages import (
    AbortNotice,
    AnyMessage,
    ErrorReply,
    PlanAccept,
    PlanRequest,
    ReleaseAck,
    ReleaseRequest,
    SecureSumRequest,
    WireMessage,
)
from protocol.plan import (
    MAX_EPSILON,
    MAX_HEADS,
    MAX_IMAGE_CROPS,
    MAX_SHOTS,
    MAX_TEXT_CHARS,
    NeighbouringRelation,
    NoiseMode,
    PrivacyUnit,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    plan_hash,
)
from protocol.release import (
    ActivationSum,
    DistributedOutcome,
    ReleaseOutcome,
    ReleaseSums,
    VoteSum,
    check_candidate_picks,
    check_plan_scope,
    run_release,
)
from protocol.release_manifest import plan_release_event, release_description, reserve_plan
from protocol.signal_estimate import SignalEstimate, predict_signal_to_noise
from protocol.stages import ALLOWED_TRANSITIONS, Stage, StageTracker
from protocol.version import DPMTV_VERSION, PROTOCOL_VERSION, check_compatible

__all__ = [
    "ALLOWED_TRANSITIONS",
    "AbortNotice",
    "ActivationSum",
    "AnyMessage",
    "DPMTV_VERSION",
    "DistributedOutcome",
    "DistributedRelease",
    "ErrorCode",
    "ErrorReply",
    "MAX_EPSILON",
    "MAX_HEADS",
    "MAX_IMAGE_CROPS",
    "MAX_SHOTS",
    "MAX_TEXT_CHARS",
    "MESSAGE_RECORD_KEY",
    "MessageDecodeError",
    "NeighbouringRelation",
    "NoiseMode",
    "PROTOCOL_VERSION",
    "PlanAccept",
    "PlanMismatchError",
    "PlanRequest",
    "PrivacyUnit",
    "ProtocolError",
    "ReleaseAck",
    "ReleaseOrder",
    "ReleaseOutcome",
    "ReleasePlan",
    "ReleaseRequest",
    "ReleaseSums",
    "RemoteError",
    "SecureSumRequest",
    "SelectionMode",
    "SignalEstimate",
    "Stage",
    "StageOrderError",
    "StageTracker",
    "VersionMismatchError",
    "VoteSum",
    "WireMessage",
    "check_candidate_picks",
    "check_compatible",
    "check_plan_scope",
    "expect",
    "message_from_record",
    "message_to_record",
    "plan_calibration",
    "plan_distributed_calibration",
    "plan_distributed_event",
    "plan_hash",
    "plan_release_event",
    "predict_signal_to_noise",
    "release_description",
    "reserve_plan",
    "run_release",
    "secure_sum_request_from_config",
    "secure_sum_request_to_config",
]
