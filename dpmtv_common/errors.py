"""The exception hierarchy of dpmtv: one root, typed leaves, builtins where they fit.

Every error dpmtv raises on purpose derives from :class:`DpmtvError`, so callers can catch
the whole family with one clause. Leaves also inherit the builtin that fits (as attrs and
pydantic-settings do), so ``except ValueError`` keeps working for bad input.

Messages follow one template: ``"<name> must <constraint>, got <value!r>."`` plus the remedy
when there is one. Across the wire an error is never pickled: it travels as
``protocol.ErrorReply(code, reason)`` and is raised again locally as ``protocol.RemoteError``.

::

    DpmtvError
    ├── ConfigError (ValueError)                bad settings, plan or argument values
    │   └── PromptTooLongError (client.models)  a prompt exceeds the model's context
    ├── DataError (ValueError)                  a site dataset or manifest is unusable
    ├── ModelError                              a model cannot be loaded, adapted or hooked
    │   ├── UnsupportedArchitectureError        no adapter is registered for the architecture
    │   └── AdapterPluginError (client.models)  an installed adapter plugin cannot be used
    ├── PrivacyError                            a privacy guarantee would not hold: fail closed
    │   ├── CalibrationError (ValueError)       no noise level meets the requested (epsilon, delta)
    │   ├── InsecureRandomnessError             a non-cryptographic noise source reached a DP path
    │   ├── PrivacyBudgetExceededError          a release would overspend a ledger's budget
    │   ├── PolicyError                         a plan or request is outside a site's own policy
    │   └── LedgerError                         the ledger is missing, corrupt or misused
    ├── CryptoError                             keys, signatures, secure aggregation
    │   ├── BadSignatureError                   a signature does not verify
    │   ├── UnknownSigningKeyError              the signing key is not among the trusted keys
    │   ├── IntegrityError                      bytes differ from what was signed or hashed
    │   └── InsufficientSharesError             too few shares or survivors to reconstruct
    ├── ArtifactError                           a task-vector artifact is unusable
    │   ├── ArtifactFormatError (ValueError)    missing file, bad JSON, bad tensor layout
    │   └── ModelMismatchError                  the artifact was made for another model
    ├── ServiceError                            the site service cannot start or be reached
    └── ProtocolError                           (subclassed in ``protocol.errors``)
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "ArtifactFormatError",
    "BadSignatureError",
    "CalibrationError",
    "ConfigError",
    "CryptoError",
    "DataError",
    "DpmtvError",
    "InsecureRandomnessError",
    "InsufficientSharesError",
    "IntegrityError",
    "LedgerError",
    "ModelError",
    "ModelMismatchError",
    "PrivacyBudgetExceededError",
    "PolicyError",
    "PrivacyError",
    "ProtocolError",
    "ServiceError",
    "UnknownSigningKeyError",
    "UnsupportedArchitectureError",
]


class DpmtvError(Exception):
    """Root of every error dpmtv raises on purpose."""


class ConfigError(DpmtvError, ValueError):
    """A setting, plan field or argument has a value dpmtv cannot use."""


class DataError(DpmtvError, ValueError):
    """A site dataset, manifest or image cannot be used as given."""


class ModelError(DpmtvError):
    """A model cannot be loaded, adapted or hooked."""


class UnsupportedArchitectureError(ModelError):
    """No adapter is registered for the model's architecture."""


class PrivacyError(DpmtvError):
    """A differential-privacy guarantee would not hold; the operation stops (fail closed)."""


class CalibrationError(PrivacyError, ValueError):
    """No noise level meets the requested privacy target."""


class InsecureRandomnessError(PrivacyError):
    """A non-cryptographic (seeded) noise source was offered to a production DP path."""


class PrivacyBudgetExceededError(PrivacyError):
    """A release would spend more than a ledger's remaining budget."""


class PolicyError(PrivacyError):
    """A plan or request lies outside the site's own policy (caps, minimum sites, mode, unit)."""


class LedgerError(PrivacyError):
    """The privacy ledger is missing, corrupt, or used out of order."""


class CryptoError(DpmtvError):
    """A key, signature or secure-aggregation step failed."""


class BadSignatureError(CryptoError):
    """A signature does not verify against the claimed key and bytes."""


class UnknownSigningKeyError(CryptoError):
    """The key that signed something is not among the trusted keys."""


class IntegrityError(CryptoError):
    """Bytes differ from the bytes that were hashed or signed."""


class InsufficientSharesError(CryptoError):
    """Too few shares or surviving participants to reconstruct or release."""


class ArtifactError(DpmtvError):
    """A task-vector artifact cannot be used."""


class ArtifactFormatError(ArtifactError, ValueError):
    """An artifact is missing a file, or a file has the wrong layout."""


class ModelMismatchError(ArtifactError):
    """An artifact was made for a model with another fingerprint."""


class ProtocolError(DpmtvError):
    """A peer broke the client/server contract (see ``protocol.errors`` for the leaves)."""


class ServiceError(DpmtvError):
    """The site service cannot start or serve, or a relay cannot reach it."""
