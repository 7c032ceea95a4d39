"""Empirical privacy audits: a canary planted in the production path, and the audit's power."""
